"""The hand-written baselines the benchmarks compare expframe's Trainer against.

`handwritten_loop`: the minimal custom training loop of the tf.distribute guide:
`distribute_datasets_from_function`, one `tf.function` running
`for _ in tf.range(k): strategy.run(step, ...)`, where `step` divides its gradients
by the replica count and calls the plain Keras `optimizer.apply_gradients` (which
sums over replicas).

`baseline_strategy`: which strategy the baselines run on. "same" (default): the
Replicator's own strategy (expframe's cross-device reduction), so a ratio measures
only the loop. "tf_default": `MirroredStrategy(devices)` as a user would write it
(on CPU devices TensorFlow then picks CollectiveAllReduce). "none" (one replica):
no tf.distribute strategy at all, what a user of one device writes (Keras `fit`
then turns XLA on by default on a GPU; under a strategy it leaves it off).

`jit_compile=True` compiles the per-replica step with XLA, as `Replicator.jit_compile`
does for expframe's.
"""

from typing import Callable

import keras
import tensorflow as tf

import expframe
from expframe.replicator import targets

STRATEGIES = ("same", "tf_default", "none")


def baseline_strategy(kind: str, num_replicas: int, target: str = "cpu") -> tf.distribute.Strategy:
    """The baselines' strategy on `target` ('cpu' or 'gpu'), see the module docstring."""
    if kind == "same":
        return expframe.Replicator(target, num_replicas, jit_compile=False).strategy
    if kind == "tf_default":
        devices = (targets.cpu_devices(num_replicas) if target == "cpu"
                   else [d.name for d in tf.config.list_logical_devices("GPU")[:num_replicas]])
        return tf.distribute.MirroredStrategy(devices=devices)
    if kind == "none" and num_replicas == 1:
        return tf.distribute.get_strategy()
    raise ValueError(f"baseline strategy {kind!r} on {num_replicas} replica(s): use one of {STRATEGIES} "
                     "('none' is for one replica)")


def replica_step(strategy: tf.distribute.Strategy, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 per_replica_dataset: Callable[[int], tf.data.Dataset], global_batch: int, num_classes: int,
                 jit_compile: bool = False):
    """(step, iterator): the per-replica training step of the tf.distribute guide (its
    gradients divided by the replica count, into the plain Keras optimizer, which sums
    over replicas) and the distributed input it reads, the optimizer built in the scope."""
    num_replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    per_replica = global_batch // num_replicas
    iterator = iter(strategy.distribute_datasets_from_function(lambda ctx: per_replica_dataset(per_replica)))

    def step(batch):
        with tf.GradientTape() as tape:
            logits = tf.cast(model(batch["image"], training=True), tf.float32)
            onehot = tf.one_hot(batch["label"], num_classes, dtype=logits.dtype)
            loss = tf.reduce_mean(keras.losses.categorical_crossentropy(onehot, logits, from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [g / num_replicas for g in grads]  # Keras sums over replicas: this makes the mean.
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return (tf.function(step, jit_compile=True) if jit_compile else step), iterator


def handwritten_loop(strategy: tf.distribute.Strategy, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                     per_replica_dataset: Callable[[int], tf.data.Dataset], global_batch: int,
                     num_classes: int, jit_compile: bool = False) -> Callable[[int], float]:
    """Returns call(k): k training steps in one tf.function call; the mean loss of the last.
    With `jit_compile`, the per-replica step is compiled with XLA. `call.traced(k)` is the
    traced host call (its concrete function)."""
    step, iterator = replica_step(strategy, model, optimizer, per_replica_dataset, global_batch, num_classes,
                                  jit_compile)

    @tf.function
    def loop(iterator, k):
        loss = strategy.run(step, args=(next(iterator),))
        for _ in tf.range(k - 1):
            loss = strategy.run(step, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, loss, axis=None)

    def call(k: int) -> float:
        return float(loop(iterator, tf.constant(k, tf.int32)))

    call.traced = lambda k: loop.get_concrete_function(iterator, tf.constant(k, tf.int32))  # for graph sizes
    return call
