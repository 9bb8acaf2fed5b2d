"""The classifier's export, served in a fresh process that never imports expframe: from a
checkpoint written by 2 replicas, its raw-image signatures (uint8 pixels, encoded bytes,
tf.Example) give what the float signature gives on the eval pipeline's images, for shapes
and ImageNet (expframe/tasks/image_serving.py, expframe/data/raw_images.py); class names
are in the outputs and in assets/labels.txt; `model.keras`, in plain Keras layers, loads
with Keras alone and equals the SavedModel (expframe/keras_copy.py); and `main.py
--mode=export` works at every `--export_precision`, mixed_float16's top-1 that of float32.

One trained run (module fixture) serves every test here; each test serves all its
exports from one process."""

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow.core.protobuf import saved_model_pb2

import expframe as xf
from expframe import checkpointer, config, export
from expframe.data import imagenet, inputs, shapes
from expframe.layers import SyncBatchNorm
from expframe.tasks.classification import ClassificationTask
from tests import main_runner as mr
from tests.export_serving import classifier_outputs, compare, serve_many

RNG = np.random.default_rng(0)
RAW = ("image_tensor", "image_bytes", "tf_example")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, data_dir):
    """experiments/quickstart.gin shrunk (tests/main_runner.SMALL): 6 steps on 2 replicas."""
    model_dir = tmp_path_factory.mktemp("quickstart") / "run"
    done = mr.run(["experiments/quickstart.gin"], model_dir, data_dir, mr.SMALL + ("Replicator.num_replicas = 2",))
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"num_replicas": 2' in (model_dir / "result.json").read_text()
    return model_dir


def _quickstart_task(model_dir, data_dir):
    """The run's ClassificationTask (its parsed config), built on 1 replica, its last
    checkpoint (step 6) read in; with the first 8 test images as the eval pipeline gives
    them (float32) and as stored (uint8)."""
    config.parse([str(model_dir / "parsed_config.gin")],
                 ["Replicator.num_replicas = 1", f"shapes_input.data_dir = '{data_dir}'"])
    rep = xf.Replicator()
    task = ClassificationTask()
    task.setup(rep, 16, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    batch = next(iter(task.eval_input_fn(tf.distribute.InputContext())))
    stored = next(iter(shapes.load_shapes("test", 32, str(data_dir), num_train=512, num_test=64).batch(8)))
    np.testing.assert_array_equal(batch["id"][:8], stored["id"])
    initial = task.model(batch["image"][:8], training=False).numpy()
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert path.endswith("ckpt-6")
    assert checkpointer.read_checkpoint(export.restorable(task, tf.Variable(0, dtype=tf.int64)), path) is None
    assert np.abs(task.model(batch["image"][:8], training=False).numpy() - initial).max() > 1e-3  # its weights
    return task, batch["image"][:8].numpy(), stored["image"].numpy()


def _imagenet_task():
    """A tiny classifier of ImageNet's 1000 classes on `imagenet_input`'s mock examples (6
    JPEGs of random sizes), 32 px; its batch norm's statistics moved off their defaults."""
    gin.parse_config(["imagenet_input.use_mock = True", "imagenet_input.image_size = 32",
                      "imagenet_input.mock_num_examples = 6"])
    rep = xf.Replicator("cpu", 1)
    model = lambda: keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(4, 3, strides=2),  # noqa: E731
                                      SyncBatchNorm(), keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
                                      keras.layers.Dense(1000)])
    task = ClassificationTask(model=model, dataset=imagenet.imagenet_input, optimizer=keras.optimizers.SGD,
                              eval_split="validation")
    task.setup(rep, 8, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    norm = task.model.layers[1]
    norm.moving_mean.assign(RNG.normal(size=4).astype(np.float32))
    norm.moving_variance.assign(RNG.uniform(0.5, 2, size=4).astype(np.float32))
    norm.gamma.assign(RNG.uniform(0.5, 2, size=4).astype(np.float32))
    images = next(iter(task.eval_input_fn(tf.distribute.InputContext())))["image"].numpy()
    jpegs, _ = imagenet._mock_arrays("validation", 6, None)  # pylint: disable=protected-access
    return task, images, list(jpegs)


def _example(encoded):
    feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded]))}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _served_raw(task, float_images, odd, pixels, encoded, names, tmp_path, name):
    """Exports `task`; (export_dir, inputs, expected). Rows: `float_images` (the eval
    pipeline's), then `odd` (an image preprocessed in-process). `serving_default` and
    model.keras get all rows; `image_tensor` the uint8 `pixels` (rows[0]: which rows they
    are); `image_bytes` and `tf_example` the `encoded` images (all rows). Each expectation:
    the model's outputs on those rows."""
    info = export.export_saved_model(task, str(tmp_path / name))
    assert sorted(info["signatures"]) == sorted(("serving_default",) + RAW), info
    assert info["assets"] == ["labels.txt"] and info["keras_model"] == str(tmp_path / name / "model.keras"), info
    float_images = np.concatenate([float_images, odd[None]]).astype(np.float32)
    logits = task.model(float_images, training=False).numpy()
    inputs = {"serving_default/image": float_images, "image_tensor/image_tensor": pixels[1],
              "image_bytes/image_bytes": np.array(encoded, dtype=bytes),
              "tf_example/tf_example": np.array([_example(e) for e in encoded], dtype=bytes),
              "keras/input": float_images}
    rows = {"serving_default": slice(None), "image_tensor": pixels[0], "image_bytes": slice(None),
            "tf_example": slice(None)}
    expected = {"keras/output": logits, "assets/labels.txt": "".join(f"{n}\n" for n in names).encode()}
    for signature, taken in rows.items():
        expected.update(classifier_outputs(logits, f"{signature}/", names, rows=taken))
    return (tmp_path / name, inputs), expected, rows


def test_raw_images_class_names_and_the_keras_copy(quickstart_run, data_dir, tmp_path):
    """Shapes from the 2-replica checkpoint (PNG bytes, and a 40x48 image resized inside),
    ImageNet on its mock JPEGs (decoded in the crop window as its eval pipeline does) and a
    PNG of one of them, decoded whole, which image_tensor gets as pixels."""
    task, float_images, pixels = _quickstart_task(quickstart_run, data_dir)
    odd = RNG.integers(0, 256, size=(40, 48, 3), dtype=np.uint8)
    pngs = [tf.io.encode_png(p).numpy() for p in (*pixels, odd)]
    shapes_served = _served_raw(task, float_images, inputs.shapes_eval_image(odd).numpy(), (slice(0, 8), pixels),
                                pngs, shapes.CLASS_NAMES, tmp_path, "shapes")
    gin.clear_config()
    task, float_images, jpegs = _imagenet_task()
    decoded = tf.io.decode_jpeg(jpegs[3], channels=3).numpy()
    whole = imagenet.preprocess_for_eval(tf.constant(decoded), 32).numpy()
    names = tfds.builder("imagenet2012").info.features["label"].names
    imagenet_served = _served_raw(task, float_images, whole, (slice(6, 7), decoded[None]),
                                  jpegs + [tf.io.encode_png(decoded).numpy()], names, tmp_path, "imagenet")
    jobs = [shapes_served[0], imagenet_served[0]]
    for (job, expected, rows), got in zip((shapes_served, imagenet_served), serve_many(jobs, tmp_path), strict=True):
        worst = compare(got, expected)
        floats = got["serving_default/logits"]
        raw = max(compare(got, {f"{s}/logits": floats[rows[s]]}) for s in RAW)
        keras_vs_saved = compare(got, {"keras/output": floats})
        print(f"{job[0].name}: served vs in-process {worst:.3g}; raw vs float signature {raw:.3g}; "
              f"model.keras vs SavedModel {keras_vs_saved:.3g}")


def _precision_exports(quickstart_run, data_dir, tmp_path):
    """`main.py --mode=export` at each precision, started together: {precision: export_dir}."""
    runs = {}
    for precision in PRECISIONS:
        out = tmp_path / precision
        runs[precision] = (out, mr.start(["experiments/quickstart.gin"], quickstart_run, data_dir,
                                         mr.SMALL + ("Replicator.num_replicas = 2",),
                                         extra=["--mode=export", f"--export_dir={out}",
                                                f"--export_precision={precision}"]))
    for precision, (out, proc) in runs.items():
        text = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, (precision, text[-3000:])
        assert f"exported step 6 (latest) to {out}: signatures image_bytes, image_tensor, serving_default, " \
               "tf_example; Keras copy model.keras" in text, text[-2000:]
    return {precision: out for precision, (out, _) in runs.items()}


def _compute_dtypes(export_dir):
    """The dtypes the SavedModel's convolutions compute in."""
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((export_dir / "saved_model.pb").read_bytes())
    graph = proto.meta_graphs[0].graph_def
    nodes = [n for f in graph.library.function for n in f.node_def] + list(graph.node)
    return {tf.dtypes.as_dtype(n.attr["T"].type).name for n in nodes if n.op == "Conv2D"}


def test_every_export_precision_through_main(quickstart_run, data_dir, tmp_path):
    """Exit 0 at each --export_precision --help offers. float32 serves the checkpoint's logits;
    the mixed exports compute in float16 and bfloat16 and give float32's top-1 on the 64
    test images, as the eval pipeline feeds them."""
    exports = _precision_exports(quickstart_run, data_dir, tmp_path)
    assert {p: _compute_dtypes(out) for p, out in exports.items()} == {
        "float32": {"float32"}, "mixed_float16": {"float16"}, "mixed_bfloat16": {"bfloat16"}}
    task, _, _ = _quickstart_task(quickstart_run, data_dir)
    images = np.concatenate([b["image"].numpy() for b in task.eval_input_fn(tf.distribute.InputContext())])
    assert images.shape == (64, 32, 32, 3)
    logits = task.model(images, training=False).numpy()
    served = dict(zip(exports, serve_many([(out, {"serving_default/image": images}) for out in exports.values()],
                                          tmp_path), strict=True))
    compare(served["float32"], classifier_outputs(logits, class_names=shapes.CLASS_NAMES))
    top1 = {p: got["serving_default/top_k_classes"][:, 0] for p, got in served.items()}
    for precision in PRECISIONS[1:]:
        differs = float(np.abs(served[precision]["serving_default/logits"] - logits).max())
        print(f"{precision}: top-1 agrees with float32 on {np.mean(top1[precision] == top1['float32']):.0%} of 64; "
              f"logits differ by up to {differs:.3g}")
        assert differs > 0  # it computes in its own precision
        np.testing.assert_array_equal(top1[precision], top1["float32"], err_msg=precision)
