"""The expframe port of custom_loop.py (docs/porting.md, first port): the tutorial's steps
as a Task. The model code is the original's, unchanged; the strategy, the distributed
dataset, the loops over epochs and steps, `strategy.run`, `strategy.reduce`, the
checkpoint and the metrics objects are expframe's (custom_loop.gin says how many of each).

    python main.py --gin_file=examples/porting/custom_loop.gin
"""

from typing import Callable, Dict, Optional

import gin
import keras
import tensorflow as tf
from custom_loop import create_model

import expframe as xf
from expframe.tasks.base import Task


@gin.configurable
class TutorialTask(Task):
    """The tutorial's train and test steps on `dataset`'s {"image", "label"} batches."""

    def __init__(self, dataset: Callable[..., tf.data.Dataset] = gin.REQUIRED,
                 optimizer: Callable[[], keras.optimizers.Optimizer] = gin.REQUIRED):
        self._dataset_fn, self._optimizer_fn = dataset, optimizer
        self.loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def build(self) -> None:  # inside the replicator's scope, as `with strategy.scope():`
        self.model = create_model()
        self.optimizer = xf.wrap_optimizer(self._optimizer_fn())  # averages gradients over replicas
        self.optimizer.build(self.model.trainable_variables)

    def trackables(self) -> Dict:  # tf.train.Checkpoint(optimizer=optimizer, model=model)
        return {"model": self.model, "optimizer": self.optimizer}

    def _input(self, split: str, ctx, batch_size: int, training: bool) -> tf.data.Dataset:
        return self._dataset_fn(split=split, ctx=ctx, batch_size=batch_size, training=training, seed=self.seed,
                                deterministic=self.deterministic)

    def train_input_fn(self, ctx):  # experimental_distribute_dataset(train_dataset)
        return self._input("train", ctx, ctx.get_per_replica_batch_size(self.global_batch_size), training=True)

    def eval_input_fn(self, ctx):  # experimental_distribute_dataset(test_dataset)
        return self._input("test", ctx, ctx.get_per_replica_batch_size(self.global_batch_size), training=False)

    def train_examples(self) -> Optional[int]:  # what Trainer.train_epochs counts in
        return int(self._input("train", tf.distribute.InputContext(), 1, training=False).cardinality())

    def train_step(self, batch) -> Dict[str, tf.Tensor]:  # runs on every replica, as train_step(inputs)
        images, labels = batch["image"], batch["label"]
        with tf.GradientTape() as tape:
            predictions = self.model(images, training=True)
            per_example_loss = self.loss_object(labels, predictions)
            # A mean over this replica's examples, not compute_average_loss (which divides
            # by the global batch), and the regularisation as it is, not scaled by
            # scale_regularization_loss: the wrapped optimizer averages over replicas.
            regularization = tf.add_n(self.model.losses)
            loss = tf.reduce_mean(per_example_loss) + regularization
        self.optimizer.minimize(loss, self.model.trainable_variables, tape)
        correct = tf.cast(tf.equal(tf.argmax(predictions, -1), labels), tf.float32)
        # Averaged over replicas (and over the steps between two log lines) by the trainer.
        return {"loss": loss, "reg_loss": regularization, "accuracy": tf.reduce_mean(correct)}

    def eval_step(self, batch) -> Dict[str, tf.Tensor]:  # test_step(inputs): sums, weighted by the mask
        images, labels, mask = batch["image"], batch["label"], batch["mask"]
        predictions = self.model(images, training=False)
        correct = tf.cast(tf.equal(tf.argmax(predictions, -1), labels), tf.float32)
        return {"count": tf.reduce_sum(mask), "loss": tf.reduce_sum(mask * self.loss_object(labels, predictions)),
                "accuracy": tf.reduce_sum(mask * correct)}
