"""The tutorial's task: least-squares regression, with its own eval metrics."""

from typing import Callable, Dict

import gin
import keras
import tensorflow as tf

import expframe as xf
from expframe.tasks.base import Task


@gin.configurable
class RegressionTask(Task):
    """Fits `model` to the "y" of `dataset`'s batches by mean squared error."""

    def __init__(self, model: Callable[[], keras.Model] = gin.REQUIRED, dataset: Callable = gin.REQUIRED,
                 optimizer: Callable[[], keras.optimizers.Optimizer] = gin.REQUIRED):
        self._model_fn, self._dataset_fn, self._optimizer_fn = model, dataset, optimizer

    def build(self) -> None:  # inside Replicator.scope(): the variables are replicated
        self.model = self._model_fn()
        self.optimizer = xf.wrap_optimizer(self._optimizer_fn())
        self.optimizer.build(self.model.trainable_variables)

    def trackables(self) -> Dict:
        return {"model": self.model, "optimizer": self.optimizer}

    def _input(self, split: str, ctx, training: bool) -> tf.data.Dataset:
        return self._dataset_fn(split=split, ctx=ctx, batch_size=ctx.get_per_replica_batch_size(
            self.global_batch_size), training=training, seed=self.seed, deterministic=self.deterministic)

    def train_input_fn(self, ctx):
        return self._input("train", ctx, training=True)

    def eval_input_fn(self, ctx):
        return self._input("test", ctx, training=False)

    def _predict(self, batch, training: bool) -> tf.Tensor:
        return tf.cast(self.model(batch["x"], training=training), tf.float32)[:, 0]

    def train_step(self, batch) -> Dict[str, tf.Tensor]:  # on every replica, its share of the batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self._predict(batch, training=True) - batch["y"]))
        self.optimizer.minimize(loss, self.model.trainable_variables, tape)  # scales for float16 too
        return {"loss": loss}

    def eval_step(self, batch) -> Dict[str, tf.Tensor]:  # sums over the examples, weighted by the mask
        error, mask = self._predict(batch, training=False) - batch["y"], batch["mask"]
        return {"count": tf.reduce_sum(mask), "mse": tf.reduce_sum(mask * tf.square(error)),
                "mae": tf.reduce_sum(mask * tf.abs(error))}
