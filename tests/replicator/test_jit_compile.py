"""Replicator.jit_compile: the XLA-compiled step trains to the numbers of the default
step, the step really goes through XLA, and what cannot work is refused in one line."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import expframe as xf
from expframe.replicator import auto_settings
from expframe.tasks.d4pg import D4PGTask
from expframe.trainer import Trainer

BATCH = 8


def _train(jit_compile, steps=4):
    """Losses and final weights of a small convnet (batch norm, momentum) on 1 CPU replica."""
    rep = xf.Replicator("cpu", 1, jit_compile=jit_compile)
    keras.utils.set_random_seed(0)
    with rep.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, padding="same"), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
        opt = xf.wrap_optimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((4 * BATCH, 8, 8, 3)).astype(np.float32),
            "y": rng.integers(0, 4, 4 * BATCH).astype(np.int32)}

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices(data).repeat().batch(ctx.get_per_replica_batch_size(BATCH))

    iterator = iter(rep.distribute(input_fn, BATCH))

    def step(batch):
        with tf.GradientTape() as tape:
            logits = model(batch["x"], training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["y"], logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True))
        return {"loss": loss}

    losses = [rep.run_steps(step, iterator, 1)["loss"] for _ in range(steps)]
    return rep, losses, [w.numpy() for w in model.weights]


def test_xla_step_gives_the_numbers_of_the_default_step():
    rep, losses, weights = _train(True)
    assert rep.compiles_steps
    default_rep, default_losses, default_weights = _train(False)
    assert not default_rep.compiles_steps
    np.testing.assert_allclose(losses, default_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains
    for w, d in zip(weights, default_weights, strict=True):
        np.testing.assert_allclose(w, d, rtol=1e-4, atol=1e-5)


def test_the_step_really_goes_through_xla():
    """A step that calls the host cannot be compiled: it fails under jit_compile=True
    (so the step was handed to XLA), with one line naming the binding, and runs without."""
    def host_step(batch):
        doubled = tf.numpy_function(lambda v: v * 2, [batch], tf.float32, stateful=False)
        return {"loss": tf.reduce_mean(tf.reshape(doubled, [-1]))}

    for jit_compile in (False, True):
        rep = xf.Replicator("cpu", 1, jit_compile=jit_compile)
        iterator = iter(rep.distribute(lambda ctx: tf.data.Dataset.from_tensors(tf.ones([2])).repeat(), 2))
        if jit_compile:
            with pytest.raises(xf.RunError, match=r"the train step failed under XLA \(.*\); set "
                                                  r"Replicator.jit_compile = False"):
                rep.run_steps(host_step, iterator, 1)
        else:
            assert rep.run_steps(host_step, iterator, 1) == {"loss": 2.0}


def test_auto_runs_a_step_that_cannot_be_traced_for_xla_uncompiled(capsys):
    def step(batch):
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError("this step cannot be traced under XLA")
        return {"loss": tf.reduce_mean(batch)}

    rep = xf.Replicator("cpu", 1, jit_compile="auto")
    rep._xla._compiles = True  # pylint: disable=protected-access  (as 'auto' decides on a GPU)
    iterator = iter(rep.distribute(lambda ctx: tf.data.Dataset.from_tensors(tf.ones([2])).repeat(), 2))
    assert rep.run_steps(step, iterator, 2) == {"loss": 1.0}
    assert rep.run_steps(step, iterator, 1) == {"loss": 1.0}
    lines = [line for line in capsys.readouterr().out.splitlines() if "jit_compile" in line]
    assert lines == ["expframe: Replicator.jit_compile='auto': the step cannot be traced for XLA "
                     "(ValueError: this step cannot be traced under XLA); it runs uncompiled"]


def test_auto_is_off_on_cpus_without_measuring():
    rep = xf.Replicator("cpu", 1)
    assert rep.jit_compile == "auto" and rep.compiles_steps is False
    assert not auto_settings.auto_jit_compile("cpu", 1, make_timer=pytest.fail)


def test_auto_on_a_gpu_follows_the_measurement(tmp_path):
    gpu = "/device:GPU:0"
    faster = auto_settings.auto_jit_compile(
        "gpu", 1, device=gpu, directory=str(tmp_path), log=[].append,
        make_timer=lambda: {"off": 2.0, "on": 1.0}.get)
    slower = auto_settings.auto_jit_compile(
        "gpu", 2, device=gpu, directory=str(tmp_path / "other"), log=[].append,
        make_timer=lambda: {"off": 1.0, "on": 1.5}.get)
    assert (faster, slower) == (True, False)
    # Where XLA cannot work, 'auto' never measures.
    for target, replicas in (("parameter_server", 1), ("mesh", 1), ("tpu", 1), ("multi_worker", 1)):
        assert not auto_settings.auto_jit_compile(target, replicas, device=gpu, make_timer=pytest.fail)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(target="cpu", num_replicas=2, jit_compile=True),
     r"Replicator.jit_compile=True on target 'cpu': XLA cannot compile a step that updates variables mirrored on "
     r"2 logical CPU devices; use Replicator.num_replicas = 1 to compile. Set Replicator.jit_compile = False"),
    (dict(target="mesh", mesh_shape={"batch": 2, "model": 1}, jit_compile=True),
     r"jit_compile=True on target 'mesh': DTensor runs the mesh's program without XLA"),
    (dict(target="cpu", jit_compile="yes"), r"Replicator.jit_compile='yes': use False, True or 'auto'"),
    (dict(target="cpu", jit_compile=1), r"Replicator.jit_compile=1: use False, True or 'auto'"),
])
def test_what_cannot_work_is_refused(kwargs, pattern):
    with pytest.raises(xf.ConfigError, match=pattern):
        xf.Replicator(**kwargs)


@pytest.mark.parametrize("target, pattern", [
    ("parameter_server", "variables on the parameter servers"),
    ("multi_worker", "no CPU kernels for the collectives"),
])
def test_cluster_targets_refuse_xla_on_cpus(target, pattern):
    assert pattern in auto_settings.xla_refusal(target, 1, "/device:CPU:0")
    assert auto_settings.xla_refusal("multi_worker", 1, "/device:GPU:0") is None
    assert auto_settings.xla_refusal("gpu", 4, "/device:GPU:0") is None


def test_a_step_that_calls_the_host_is_refused_before_anything_is_built():
    trainer = Trainer(train_steps=1, global_batch_size=4)
    task = D4PGTask()
    with pytest.raises(xf.ConfigError, match=r"jit_compile=True, but D4PGTask's train step sends its TD errors to "
                                             r"the host \(tf.numpy_function\), which XLA cannot compile"):
        trainer.prepare(xf.Replicator("cpu", 1, jit_compile=True), task, seed=0, deterministic=False)
    assert not hasattr(task, "environment")  # refused before the task's set-up
