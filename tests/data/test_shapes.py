"""Tests for the offline `shapes` TFDS builder (small builds in temporary dirs)."""

import re
import socket

import numpy as np
import pytest
import tensorflow_datasets as tfds

from expframe.data import shapes

NUM_TRAIN, NUM_TEST = 500, 100


def _build(data_dir, size=32, num_train=NUM_TRAIN, num_test=NUM_TEST):
    """Prepares a small `shapes` build with the network cut off; returns the builder."""

    def no_network(*args, **kwargs):
        raise AssertionError(f"shapes tried to reach the network: {args}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", no_network)
        mp.setattr(socket, "create_connection", no_network)
        shapes.load_shapes("test", size=size, data_dir=str(data_dir), num_train=num_train, num_test=num_test)
    return shapes.Shapes(config=shapes.shapes_config(size, num_train, num_test), data_dir=str(data_dir))


def _arrays(builder, split):
    ds = builder.as_dataset(split=split, shuffle_files=False)
    examples = list(tfds.as_numpy(ds))
    return {key: np.stack([ex[key] for ex in examples]) for key in ("image", "label", "id")}


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("shapes_a"))


def test_small_build_has_requested_sizes(small_build):
    info = small_build.info
    assert small_build.builder_config.name == f"32x32_train{NUM_TRAIN}_test{NUM_TEST}"
    assert info.splits["train"].num_examples == NUM_TRAIN
    assert info.splits["test"].num_examples == NUM_TEST
    assert info.features["label"].names == list(shapes.CLASS_NAMES)
    assert info.supervised_keys == ("image", "label")


@pytest.mark.parametrize("split, count", [("train", NUM_TRAIN), ("test", NUM_TEST)])
def test_examples_shapes_labels_and_ids(small_build, split, count):
    data = _arrays(small_build, split)
    assert data["image"].shape == (count, 32, 32, 3) and data["image"].dtype == np.uint8
    assert data["label"].dtype == np.int64 and data["id"].dtype == np.int64
    assert data["label"].min() >= 0 and data["label"].max() < shapes.NUM_CLASSES
    # Ids are 0..N-1, each exactly once, stored in id order.
    np.testing.assert_array_equal(data["id"], np.arange(count))
    # Images are not blank: both the background and the shape vary.
    assert data["image"].std(axis=(1, 2, 3)).min() > 5


def test_all_classes_appear(small_build):
    labels = _arrays(small_build, "train")["label"]
    assert shapes.NUM_CLASSES >= 10
    assert set(labels.tolist()) == set(range(shapes.NUM_CLASSES))


def test_train_and_test_differ(small_build):
    train, test = _arrays(small_build, "train"), _arrays(small_build, "test")
    assert not np.array_equal(train["image"][:NUM_TEST], test["image"])


def test_builds_are_deterministic(small_build, tmp_path):
    other = _build(tmp_path, num_train=NUM_TRAIN, num_test=NUM_TEST)
    for split in ("train", "test"):
        a, b = _arrays(small_build, split), _arrays(other, split)
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


def test_stored_examples_match_generate(small_build):
    data = _arrays(small_build, "test")
    images, labels, ids = shapes.generate("test", 20, size=32)
    np.testing.assert_array_equal(data["image"][:20], images)
    np.testing.assert_array_equal(data["label"][:20], labels)
    np.testing.assert_array_equal(ids, np.arange(20))


def test_generate_depends_only_on_id():
    # Examples 995..1004 straddle two RNG chunks; drawing them alone gives the same bytes.
    images, labels, ids = shapes.generate("train", 10, size=32, start=995)
    all_images, all_labels, _ = shapes.generate("train", 1005, size=32)
    np.testing.assert_array_equal(images, all_images[995:])
    np.testing.assert_array_equal(labels, all_labels[995:])
    np.testing.assert_array_equal(ids, np.arange(995, 1005))


def test_64x64_config(tmp_path):
    builder = _build(tmp_path, size=64, num_train=20, num_test=10)
    data = _arrays(builder, "train")
    assert data["image"].shape == (20, 64, 64, 3) and data["image"].dtype == np.uint8
    np.testing.assert_array_equal(data["id"], np.arange(20))


def test_registered_configs_load_by_name(tmp_path):
    assert tfds.builder_cls("shapes") is shapes.Shapes
    for name, size, num_train in (("32x32", 32, 20_000), ("64x64", 64, 10_000)):
        builder = tfds.builder(f"shapes/{name}", data_dir=str(tmp_path))
        assert builder.builder_config.image_size == size
        assert builder.builder_config.num_train == num_train
        assert shapes.shapes_config(size) is builder.builder_config
    assert tfds.builder("shapes", data_dir=str(tmp_path)).builder_config.name == "32x32"


def test_bad_arguments_say_what_to_use():
    with pytest.raises(ValueError, match=r"size=48.*\[32, 64\]"):
        shapes.shapes_config(48)
    with pytest.raises(ValueError, match="unknown split 'validation'"):
        shapes.generate("validation", 1)


def test_a_build_says_it_generates_locally_not_that_it_downloads(tmp_path, capfd):
    # TFDS printed "Downloading and preparing dataset Unknown size (download: Unknown size, ...)"
    # though nothing is downloaded (issue 51); the builder overrides the two methods that print it.
    assert all(callable(getattr(tfds.core.DatasetBuilder, name, None)) for name in shapes._TFDS_MESSAGES)
    capfd.readouterr()
    builder = _build(tmp_path, num_train=30, num_test=10)
    out = capfd.readouterr().out
    where = tmp_path / "shapes" / "32x32_train30_test10" / "2.0.0"
    assert "Download" not in out and "download" not in out.replace("nothing is downloaded", ""), out
    assert (f"shapes/32x32_train30_test10: generating 30 train and 10 test images locally (drawn with numpy; "
            f"nothing is downloaded) into {where} ...\n") in out
    done = re.search(r"shapes/32x32_train30_test10: generated 40 images locally in (\d+\.\d) s: (\d+\.\d+) KiB in "
                     rf"{re.escape(str(where))}; later runs reuse them\.\n", out)
    assert done, out
    on_disk = sum(p.stat().st_size for p in where.iterdir())  # the records, dataset_info.json, features.json
    assert float(done.group(2)) * 1024 == pytest.approx(on_disk, abs=10)
    assert on_disk > int(builder.info.dataset_size) > 0
    _build(tmp_path, num_train=30, num_test=10)  # prepared already: nothing is said
    assert "shapes/" not in capfd.readouterr().out
