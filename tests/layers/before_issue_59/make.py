"""Writes the checkpoint tests/layers/test_sync_batch_norm_compat.py restores: a small
model with SyncBatchNorm as the layer was before issue 59 (gathered moments, merged with
Chan's formula), read from git at COMMIT, after two training steps on 4 CPU replicas.

    python tests/layers/before_issue_59/make.py     # from the repository root

Writes `ckpt-1.*` (a tf.train.Checkpoint of the model) and `values.json` (every
variable, and the model's inference output on a fixed input) beside this file.
"""

import json
import os
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
COMMIT = "8c58447"  # main before issue 59
sys.path.insert(0, ROOT)

import expframe as xf  # noqa: E402

xf.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def old_sync_batch_norm():
    """The module as it was at COMMIT (its Keras registration left out: the name is taken)."""
    source = subprocess.check_output(["git", "show", f"{COMMIT}:expframe/layers/sync_batch_norm.py"], cwd=ROOT,
                                     text=True)
    source = source.replace('@keras.saving.register_keras_serializable(package="expframe")\n', "")
    module = types.ModuleType("sync_batch_norm_before_59")
    exec(compile(source, "sync_batch_norm_before_59.py", "exec"), module.__dict__)  # noqa: S102
    return module


def build(norm) -> keras.Model:
    """The model the test rebuilds with today's SyncBatchNorm: both variants of the layer."""
    return keras.Sequential(name="model", layers=[
        keras.Input((4, 4, 3)),
        keras.layers.Conv2D(8, 3, padding="same", name="conv1"),
        norm(momentum=0.5, name="bn1"),
        keras.layers.ReLU(),
        keras.layers.Conv2D(6, 3, padding="same", name="conv2"),
        norm(momentum=0.5, group_size=2, name="bn2"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(2, name="head"),
    ])


def probe():
    return np.random.default_rng(7).normal(3.0, 2.0, size=(5, 4, 4, 3)).astype(np.float32)


def main() -> None:
    old = old_sync_batch_norm()
    rep = xf.Replicator(target="cpu", num_replicas=4)
    with rep.scope():
        model = build(old.SyncBatchNorm)
        optimizer = xf.wrap_optimizer(keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(8, 4, 4, 3)).astype(np.float32)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    run = tf.function(lambda v: rep.run(step, v))
    for _ in range(2):
        run(rep.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(data[2 * ctx.replica_id_in_sync_group:2 * ctx.replica_id_in_sync_group + 2])))
    path = tf.train.Checkpoint(model=model).write(os.path.join(HERE, "ckpt-1"))
    values = {v.path: np.asarray(rep.local_results(v.value)[0]).tolist() for v in model.weights}
    with rep.scope():
        output = model(probe(), training=False)
    with open(os.path.join(HERE, "values.json"), "w", encoding="utf-8") as f:
        json.dump({"commit": COMMIT, "variables": values, "output": np.asarray(output).tolist()}, f)
    print(f"wrote {path} and values.json")


if __name__ == "__main__":
    main()
