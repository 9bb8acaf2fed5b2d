"""benchmarks/imagenet_input.py: its variants differ from the shipped preprocessing only in
the step they name, its generated ImageNet is what the shipped pipelines read, and its JSON
gives the results page one figure per runner and comparison, each with its spread."""

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from expframe.data import imagenet
from expframe.reproduce import figures, page, registry, running
from tests import main_runner as mr
from tests.test_results_figures import _record


@pytest.fixture(scope="module")
def bench():
    where = os.path.join(mr.ROOT, "benchmarks")
    sys.path.insert(0, where)
    try:
        import imagenet_input as module  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.remove(where)
    return module


def _jpegs(bench, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [bench.encode(bench.natural_image(h, w, rng, 4.0)) for h, w in sizes]


def test_each_variant_changes_only_its_step(bench):
    jpeg = tf.constant(_jpegs(bench, [(90, 120)])[0])
    seed = tf.constant([3, 17], tf.int64)
    shipped = imagenet.preprocess_for_train(jpeg, seed, 64)
    tf.debugging.assert_equal(bench.recipe(jpeg, seed, 64), shipped)  # nothing changed: the shipped function
    for change in ({"antialias": False}, {"normalise": False}):
        assert not np.allclose(bench.recipe(jpeg, seed, 64, **change), shipped), change
    assert bench.recipe(jpeg, seed, 64, stateless=False).shape == (64, 64, 3)  # stateful: a draw of its own
    # Decoding the whole JPEG and then cropping gives the same pixels up to the decoder's rounding.
    assert np.abs((bench.recipe(jpeg, seed, 64, fused=False) - shipped).numpy()).mean() < 0.05
    # The standard recipe: [0, 255] pixels, not normalised.
    image = bench.standard(jpeg, seed, 64).numpy()
    assert image.shape == (64, 64, 3) and image.min() >= 0 and image.max() <= 255 and image.max() > 10


def test_sizes_are_imagenet_like(bench):
    sizes = np.array(bench.image_sizes(2000, np.random.default_rng(0)))
    pixels = sizes[:, 0] * sizes[:, 1]
    assert 170e3 < pixels.mean() < 210e3                         # about 500x375 (187.5k)
    assert 0.7 < np.mean(sizes.max(axis=1) == 500) < 0.8          # ImageNet's mode: a long side of 500
    assert 0.15 < np.mean(sizes[:, 0] > sizes[:, 1]) < 0.3        # some portrait


def test_the_pipelines_read_the_generated_jpegs(bench, tmp_path):
    jpegs = _jpegs(bench, [(48, 64), (64, 48), (40, 40), (50, 70)] * 2)
    data_dir, manual = str(tmp_path / "tfds"), str(tmp_path / "manual")
    names = imagenet._builder(data_dir).info.features["label"].names
    bench.write_manual_dir(manual, jpegs, names)
    builder = bench.prepare(data_dir, manual, shards=2)
    assert [len(builder.info.splits[s].file_instructions) for s in ("train", "validation")] == [2, 2]
    for split in ("train", "validation"):  # the records hold the JPEGs' bytes as they were
        stored = [ex["image"] for ex in builder.as_dataset(split=split, decoders={
            "image": tfds.decode.SkipDecoding()}).as_numpy_iterator()]
        assert sorted(stored) == sorted(jpegs), split
    config = {"batch": 4, "image_size": 32, "data_dir": data_dir, "jpegs": jpegs}
    for runner in bench.RUNNERS:
        batch = next(iter(runner.build(config).with_options(bench.thread_options(runner.threads))))
        assert batch["image"].shape == (4, 32, 32, 3), runner.name


def _samples(rates, threads=1):
    return {"seconds": [64 / r for r in rates], "images": [64] * len(rates), "cpu_s": [64 / r * threads for r in rates]}


def test_rows_carry_their_spreads_on_the_page(bench, tmp_path):
    rates = {"train_1": [200, 210, 205, 190, 200], "train_2": [380, 400, 390, 385, 395],
             "standard_1": [300, 310, 305, 295, 300], "train_memory_1": [220, 230, 225, 210, 220],
             "no_antialias_1": [290, 300, 295, 280, 290]}
    runners = [r for r in bench.RUNNERS if r.name in rates]
    samples = {name: _samples(values, 2 if name.endswith("_2") else 1) for name, values in rates.items()}
    summary = bench.summarise(runners, samples)
    assert summary["train_2"]["per_core"]["median"] == pytest.approx(195) and summary["train_2"]["cores_busy"] == 2
    data = {"runners": summary, "comparisons": bench.comparisons(samples), "why": bench.why(samples, summary)}
    assert [c["name"] for c in data["comparisons"]] == ["train_over_standard", "train_2_over_1"]
    assert [w["name"] for w in data["why"]] == ["reading", "antialias", "all_preprocessing"]
    assert data["comparisons"][0]["spread"]["median"] == pytest.approx(200 / 300)
    result = registry.get("imagenet_input")
    rows = result.rows(data)
    assert len(rows) == 5 + 2 + 3 and all(r["spread"] and r["goal"] is None for r in rows)
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    os.makedirs(os.path.join(work, running.RECORDS))
    rec = _record(rows, name=result.name)  # the page tests' record, this benchmark's rows
    with open(running.record_path(work, result.name), "w", encoding="utf-8") as f:
        json.dump(rec, f)
    text = open(page.write(work, out, False, [result], {result.name: "x"}, []), encoding="utf-8").read()
    body = text.split(f'<a id="{result.name}"></a>', 1)[1]
    lines = [line for line in body.splitlines() if line.startswith("| ") and "images/s" in line]
    assert len(lines) == len(rows)
    for line in lines:  # every figure shows its interval and its 5 repeats
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert " to " in cells[3] and cells[4] == "5", line
    assert "| shipped train pipeline (imagenet_input, from its records), images/s per core, 1 thread(s) | 200 |" in body
    assert figures.not_for_quoting(text) == []
