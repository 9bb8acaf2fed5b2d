"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", pasted into an
expframe task as a user porting it would (issue 51): its model, with L2 kernel
regularizers, and its loss, divided by the global batch with
`tf.nn.compute_average_loss` and its regularisation by the replicas with
`tf.nn.scale_regularization_loss`. Imported by gin files (`import
tests.conformance.tutorial_task`), as a user's own task module would be."""

import gin
import keras
import tensorflow as tf

from expframe.tasks.classification import ClassificationTask


@gin.configurable
def tutorial_model(num_classes: int = 10, input_shape=(32, 32, 3), l2: float = 1e-5) -> keras.Model:
    """The tutorial's CNN (its `create_model`), on the shapes images."""
    regularizer = keras.regularizers.L2(l2)
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(8, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
        keras.layers.Dense(num_classes),
    ])


@gin.configurable
class TutorialTask(ClassificationTask):
    """ClassificationTask whose step is the tutorial's `train_step`, loss and all."""

    def build(self) -> None:
        super().build()
        self.loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(self, batch):
        GLOBAL_BATCH_SIZE = self.global_batch_size  # noqa: N806  (the tutorial's name)
        model, labels = self.model, batch["label"]
        with tf.GradientTape() as tape:
            predictions = model(batch["image"], training=True)
            per_example_loss = self.loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return {"loss": loss}
