"""A user's task that makes the D4PG mistake (issue 18, item 2): it differentiates the
unscaled loss and hands the gradients to the wrapped optimizer, which unscales them.

Imported by a gin file (`import tests.conformance.forgetful_task`), as a user's own
task module would be."""

import gin
import tensorflow as tf

from expframe.tasks.classification import ClassificationTask


@gin.configurable
class ForgetfulTask(ClassificationTask):
    """ClassificationTask whose step forgets `scale_loss` (and does not use `minimize`)."""

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            logits = tf.cast(self.model(batch["image"], training=True), tf.float32)
            loss = tf.reduce_mean(self._cross_entropy(batch["label"], logits))
        variables = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return {"loss": loss}
