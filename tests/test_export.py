"""Export for serving (expframe/export.py, `Task.serving`): each family's SavedModel, loaded
in a fresh Python process that never imports expframe, gives the framework model's outputs
(within 1e-5) on fixed inputs (the classifier's, from a checkpoint of 2 replicas, with raw
images, class names, its `.keras` copy and each precision: test_export_classifier.py).
Also: the base Task's error, a refused non-empty export_dir, an export that fails
part-way leaving nothing, and docs/extending.md's user-task example."""

import functools
import importlib
import os
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import expframe as xf
from expframe import checkpointer, export
from expframe.errors import ConfigError, RunError
from expframe.layers import SNDense
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from expframe.models.pixel_encoder import drq_encoder
from expframe.models.vit import ViT
from expframe.replicator import mesh
from expframe.replicator.mesh_optimizer import MeshAdam
from expframe.rl.environments import control_suite
from expframe.tasks import gan_standing
from expframe.tasks.base import Task
from expframe.tasks.d4pg import D4PGTask
from expframe.tasks.mesh_classification import MeshClassificationTask
from tests import main_runner as mr
from tests.export_serving import assert_served, classifier_outputs
from tests.support import clean_gin  # noqa: F401  (autouse: gin cleared around each test)
from tests.tasks import test_gan

RNG = np.random.default_rng(0)


# -- the contract ---------------------------------------------------------------------------


def test_the_base_task_declares_no_serving_signature(tmp_path):
    class NoServing(Task):
        pass

    with pytest.raises(ConfigError) as e:
        export.export_saved_model(NoServing(), str(tmp_path / "export"))
    assert str(e.value) == "NoServing declares no serving signature: override Task.serving (docs/extending.md)."
    assert os.listdir(tmp_path) == []


class _Identity(Task):
    def serving(self):
        fn = tf.function(lambda x: {"y": x + 1.0}, input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        return {"serving_default": fn}


def test_refuses_a_non_empty_export_dir_and_replaces_an_empty_one(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--export_dir=.*full exists and is not empty"):
        export.export_saved_model(_Identity(), str(full))
    assert os.listdir(full) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["full"]  # no temporary left
    (tmp_path / "empty").mkdir()
    info = export.export_saved_model(_Identity(), str(tmp_path / "empty"))
    assert info["signatures"] == {"serving_default": {"inputs": {"x": {"dtype": "float32", "shape": [None]}},
                                                      "outputs": ["y"]}}
    assert "saved_model.pb" in os.listdir(tmp_path / "empty") and sorted(os.listdir(tmp_path)) == ["empty", "full"]


class _WithKeras(_Identity):
    def serving_assets(self):
        return {"notes.txt": "one\n"}

    def keras_model(self):
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_an_export_that_cannot_be_written_whole_leaves_nothing(tmp_path, monkeypatch):
    """A disk that fills while model.keras, the last file, is written: one line, and neither
    the export nor its temporary folder is left. Then the whole export, model.keras included."""
    def full_disk(model, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PK")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(keras.Model, "save", full_disk)
    with pytest.raises(RunError) as e:
        export.export_saved_model(_WithKeras(), str(tmp_path / "out"))
    assert str(e.value) == (f"--export_dir={tmp_path / 'out'}: the export could not be written (OSError: [Errno 28] "
                            "No space left on device); nothing was left there.")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    info = export.export_saved_model(_WithKeras(), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["assets", "fingerprint.pb", "model.keras", "saved_model.pb",
                                                    "variables"]
    assert (tmp_path / "out" / "assets" / "notes.txt").read_text() == "one\n"
    assert (info["assets"], info["keras_model"], info["no_keras_model"]) == (
        ["notes.txt"], str(tmp_path / "out" / "model.keras"), None)
    assert keras.models.load_model(info["keras_model"]).layers[0].units == 2


def test_a_model_without_a_plain_copy_is_exported_without_one_and_says_why(tmp_path, capsys):
    class WithSpectralNorm(_Identity):
        def keras_model(self):
            return keras.Sequential([keras.Input((3,)), SNDense(2, name="sn")])

    info = export.export_saved_model(WithSpectralNorm(), str(tmp_path / "out"))
    why = "layer 'sn' (SNDense) has no plain Keras equivalent"
    assert capsys.readouterr().out == f"export: no model.keras beside the SavedModel: {why}\n"
    assert (info["keras_model"], info["no_keras_model"]) == (None, why)
    assert "saved_model.pb" in os.listdir(tmp_path / "out") and not (tmp_path / "out" / "model.keras").exists()


def test_refuses_signatures_that_break_the_contract(tmp_path):
    class NoDefault(Task):
        def serving(self):
            return {"other": _Identity().serving()["serving_default"]}

    class NoSignature(Task):
        def serving(self):
            return {"serving_default": tf.function(lambda x: {"y": x})}

    with pytest.raises(ConfigError, match="NoDefault.serving must return a dict of signatures holding 'serving_"):
        export.export_saved_model(NoDefault(), str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"NoSignature.serving\(\)\['serving_default'\] is not a tf.function with"):
        export.export_saved_model(NoSignature(), str(tmp_path / "b"))

    class FolderAsset(_Identity):
        def serving_assets(self):
            return {"../labels.txt": "a\n"}

    with pytest.raises(ConfigError, match=r"FolderAsset.serving_assets\(\) must map plain file names to text; got "
                                          r"'../labels.txt': str"):
        export.export_saved_model(FolderAsset(), str(tmp_path / "c"))
    assert os.listdir(tmp_path) == []


class _CompiledModel(Task):
    """A compiled Keras model (Keras' own optimizer inside it) and a wrapped optimizer, as
    KerasModelTask holds them; built in the replicator's scope under the policy in force."""

    def __init__(self):
        self.model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        self.model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        self.model.optimizer.build(self.model.trainable_variables)
        self.optimizer = xf.wrap_optimizer(keras.optimizers.Adam())
        self.optimizer.build(self.model.trainable_variables)

    def trackables(self):
        return {"model": self.model, "optimizer": self.optimizer}


@pytest.mark.parametrize("written, exported", [("float32", "mixed_float16"), ("mixed_float16", "float32")])
def test_an_export_reads_the_weights_whatever_precision_shaped_the_optimizers(written, exported, tmp_path):
    """Under mixed_float16, wrap_optimizer adds loss scaling and compile() wraps the model's
    optimizer in a LossScaleOptimizer: a checkpoint of another precision lacks that state
    (or holds state this one lacks, under the same names), so the evaluator's strict read
    fails; the export's reads every weight and leaves the optimizers out."""
    rep = xf.Replicator("cpu", 1)
    try:
        keras.mixed_precision.set_global_policy(written)
        with rep.scope():
            source = _CompiledModel()
        source.model.layers[0].kernel.assign(RNG.normal(size=(3, 2)))
        path = tf.train.Checkpoint(step=tf.Variable(7, dtype=tf.int64), **source.trackables()).save(
            str(tmp_path / "ckpt"))  # as the trainer saves it
        keras.mixed_precision.set_global_policy(exported)
        with rep.scope():
            task = _CompiledModel()
        step = tf.Variable(0, dtype=tf.int64)
        with pytest.raises((AssertionError, tf.errors.InvalidArgumentError)):  # unbound, or another dtype
            tf.train.Checkpoint(step=step, **task.trackables()).read(path).expect_partial() \
                .assert_existing_objects_matched()
        assert checkpointer.read_checkpoint(export.restorable(task, step), path) is None
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert int(step.numpy()) == 7
    np.testing.assert_array_equal(task.model.layers[0].kernel.numpy(), source.model.layers[0].kernel.numpy())
    assert isinstance(task.model.optimizer, keras.optimizers.LossScaleOptimizer) == (exported == "mixed_float16")


# -- the families ---------------------------------------------------------------------------


def test_mesh_vit_saves_plain_variables(tmp_path):
    rep = xf.Replicator(target="mesh", mesh_shape={"batch": 2, "model": 2})
    task = MeshClassificationTask(model=functools.partial(ViT, num_classes=4, image_size=8, patch_size=4, width=16,
                                                          depth=1, num_heads=4, mlp_dim=32, stem_widths=(4,)),
                                  dataset=lambda **_: None, optimizer=functools.partial(MeshAdam, learning_rate=0.05))
    task.setup(rep, 4, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    images = RNG.normal(size=(4, 8, 8, 3)).astype(np.float32)
    batch = {"image": tf.constant(images), "label": tf.range(4)}
    rep.run(tf.function(task.train_step), batch)  # the biases move away from their zeros
    logits = mesh.to_host(rep.run(tf.function(task.model), batch["image"]))
    assert_served(task, {"serving_default/image": images}, classifier_outputs(logits), tmp_path)

    class Sharded(Task):  # a signature that reads the DTensor variables themselves
        def serving(self):
            return {"serving_default": tf.function(lambda x: {"y": x + task.model.head_bias},
                                                   input_signature=[tf.TensorSpec([4], tf.float32, name="x")])}

    with pytest.raises(ConfigError, match=r"Sharded.serving\(\)\['serving_default'\] reads the DTensor variable"):
        export.export_saved_model(Sharded(), str(tmp_path / "sharded"))
    assert not (tmp_path / "sharded").exists()


def test_gan_samples_with_the_standing_statistics_and_serves_the_online_generator(tmp_path):
    _, task, _ = test_gan.train(1, steps=2)
    z = RNG.normal(size=(6, test_gan.Z)).astype(np.float32)
    labels = np.arange(6, dtype=np.int32) % test_gan.CLASSES
    inputs = {f"{name}/{key}": value for name in ("serving_default", "online")
              for key, value in (("z", z), ("label", labels))}
    copied = task.sampler([z, labels], training=False).numpy()

    def expected():  # after the export, which estimated the standing statistics
        standing = task.standing_statistics
        values = [(v, standing[v.path]) for norm in gan_standing.batch_norms(task.sampler)
                  for v in (norm.moving_mean, norm.moving_variance)]
        with gan_standing.applied(values):
            sampled = task.sampler([z, labels], training=False).numpy()
        assert np.abs(sampled - copied).max() > 1e-4  # the standing statistics, not the copied ones
        return {"serving_default/image": sampled, "online/image": task.generator([z, labels], training=False).numpy()}

    assert_served(task, inputs, expected, tmp_path)
    np.testing.assert_array_equal(task.sampler([z, labels], training=False).numpy(), copied)  # the task's untouched
    assert task.keras_model() is None and not (tmp_path / "export" / "model.keras").exists()


def _d4pg_task(**overrides):
    kwargs = dict(environment=functools.partial(control_suite, name="cartpole/balance"),
                  policy_network=functools.partial(d4pg_policy, layer_sizes=(16,)),
                  critic_network=functools.partial(d4pg_critic, layer_sizes=(16,), num_atoms=11, v_min=-20.0,
                                                   v_max=20.0), min_replay_size=8, eval_episodes=1)
    kwargs.update(overrides)
    rep = xf.Replicator("cpu", 1)
    task = D4PGTask(**kwargs)
    task.setup(rep, 8, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    return task


def _observations(task, count=4):
    """Observations the actor feeds the policy: from the environment's first steps."""
    env, out = task.eval_environment, [task.eval_environment.reset()]
    for _ in range(count - 1):
        out.append(env.step(RNG.uniform(-1, 1, env.action_size).astype(np.float32))[0])
    return np.stack(out)


@pytest.mark.parametrize("pixels", [False, True], ids=["states", "pixels"])
def test_d4pg_serves_the_noiseless_policy(pixels, tmp_path):
    encoder = functools.partial(drq_encoder, num_filters=4, num_layers=2, feature_size=8)
    task = _d4pg_task(**(dict(environment=functools.partial(control_suite, name="cartpole/swingup", pixels=True,
                                                            size=16, frame_stack=2), observation_network=encoder)
                         if pixels else {}))
    try:
        observations = _observations(task)
        assert observations.dtype == (np.uint8 if pixels else np.float32)
        features = task.observation_network(observations) if pixels else observations
        actions = task.policy(features, training=False).numpy()
        assert np.abs(actions).max() > 0
        assert_served(task, {"serving_default/observation": observations}, {"serving_default/action": actions},
                      tmp_path)
    finally:
        task.close()


# -- docs/extending.md's example ------------------------------------------------------------


def test_the_user_task_example_of_extending_md(tmp_path):
    """The page's block, as a module beside examples/regression's (on sys.path, as a gin file's folder is)."""
    with open(os.path.join(mr.ROOT, "docs", "extending.md"), encoding="utf-8") as f:
        block = re.search(r"<!-- run by: tests/test_export.py -->\n```python\n(.*?)```", f.read(), re.S).group(1)
    (tmp_path / "served_regression.py").write_text(block)
    sys.path[:0] = [str(tmp_path), os.path.join(mr.ROOT, "examples", "regression")]
    try:
        served = importlib.import_module("served_regression")
        mlp = importlib.import_module("mlp_model").mlp
    finally:
        del sys.path[:2]
    rep = xf.Replicator("cpu", 1)
    task = served.ServedRegressionTask(model=mlp, dataset=None, optimizer=keras.optimizers.Adam)
    task.setup(rep, 8, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    x = RNG.normal(size=(7, 8)).astype(np.float32)
    y = task.model(x, training=False).numpy()[:, 0]
    assert_served(task, {"serving_default/x": x}, {"serving_default/y": y}, tmp_path)
