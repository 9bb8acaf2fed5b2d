"""Image classification of a mesh model (DTensor variables) with a mesh optimizer.

`ClassificationTask` with two differences: the model is a `tf.Module` of
tensor-parallel layers (e.g. `@ViT`), built inside `Replicator.scope()` of a
`Replicator(target='mesh')`, and the optimizer is `@MeshAdam` (its slots laid out
like the variables) instead of a wrapped Keras optimizer. Losses and metrics use
plain TensorFlow ops, which the SPMD pass partitions.
"""

from typing import Dict

import gin
import tensorflow as tf

import expframe as xf
from expframe import schedules
from expframe.tasks.classification import ClassificationTask


@gin.configurable
class MeshClassificationTask(ClassificationTask):
    """Trains a mesh `model` (outputs logits, has `num_classes`) with a mesh `optimizer`.

    Args: as `ClassificationTask`; `optimizer` builds a `MeshAdam`.
    """

    def setup(self, replicator, global_batch_size: int, seed: int, deterministic: bool) -> None:
        if replicator.mesh_target is None:
            raise xf.ConfigError(
                f"MeshClassificationTask needs Replicator.target='mesh' (the target is "
                f"{replicator.target!r}); set Replicator.target and Replicator.mesh_shape.")
        super().setup(replicator, global_batch_size, seed, deterministic)

    def build(self) -> None:
        self.model = self._model_fn()
        self.num_classes = int(self.model.num_classes)
        with schedules.training_run(self.examples_per_step, self.train_examples):
            self.optimizer = self._optimizer_fn()
        self.optimizer.build(self.model.trainable_variables)
        self._decayed = [v for v in self.model.trainable_variables if len(v.shape) >= 2]

    def _cross_entropy(self, labels, logits):
        onehot = tf.one_hot(tf.cast(labels, tf.int32), self.num_classes, dtype=logits.dtype)
        if self.label_smoothing:
            onehot = onehot * (1 - self.label_smoothing) + self.label_smoothing / self.num_classes
        return tf.nn.softmax_cross_entropy_with_logits(onehot, logits)

    def train_step(self, batch) -> Dict[str, tf.Tensor]:
        images, labels = batch["image"], tf.cast(batch["label"], tf.int32)
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            logits = self.model(images)
            cross_entropy = tf.reduce_mean(self._cross_entropy(labels, logits))
            loss = cross_entropy
            if self.weight_decay:
                loss += self.weight_decay * tf.add_n([tf.nn.l2_loss(v) for v in self._decayed])
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
        return {"loss": loss, "cross_entropy": cross_entropy, "accuracy": tf.reduce_mean(correct)}

    def eval_step(self, batch) -> Dict[str, tf.Tensor]:
        images, labels = batch["image"], tf.cast(batch["label"], tf.int32)
        logits = self.model(images)
        mask = tf.cast(batch["mask"], tf.float32) if "mask" in batch else tf.ones_like(labels, tf.float32)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
        return {"count": tf.reduce_sum(mask), "loss": tf.reduce_sum(mask * self._cross_entropy(labels, logits)),
                "top1": tf.reduce_sum(mask * correct)}
