"""The original of docs/porting.md's first port: TensorFlow's tutorial "Custom training
with tf.distribute.Strategy" (tensorflow.org/tutorials/distribute/custom_training), in its
shape and with its names, on the project's shapes images instead of Fashion-MNIST.

Three changes from the tutorial: `optimizer.build(...)` in the scope (Keras 3 makes an
optimizer's slot variables on first use, which fails inside `strategy.run` with 2
replicas: "You must feed a value for placeholder tensor"), and, to compare runs step by
step, a seeded shuffle (`seed=SEED`, with `keras.utils.set_random_seed`) and `main`
returning every step's loss. Its expframe port is custom_loop_task.py with custom_loop.gin.

    python examples/porting/custom_loop.py --cpu_replicas=2 --epochs=2
"""

import argparse
import os
import tempfile
from typing import List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from shapes_data import load_data

SEED = 0
BATCH_SIZE_PER_REPLICA = 32
EPOCHS = 10


def create_model() -> keras.Model:
    """The tutorial's CNN, with its L2 regularisers (its loss adds `model.losses`)."""
    regularizer = keras.regularizers.L2(1e-5)
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
        keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])


def main(devices: Optional[Sequence[str]] = None, epochs: int = EPOCHS,
         batch_size_per_replica: int = BATCH_SIZE_PER_REPLICA, num_train: int = 2048, num_test: int = 512,
         checkpoint_dir: Optional[str] = None,
         cross_device_ops: Optional[tf.distribute.CrossDeviceOps] = None) -> List[float]:
    """Trains as the tutorial does; returns the loss of every step (the global mean)."""
    keras.utils.set_random_seed(SEED)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    (train_images, train_labels), (test_images, test_labels) = load_data(num_train, num_test)
    train_images, test_images = train_images / np.float32(255), test_images / np.float32(255)
    BUFFER_SIZE = len(train_images)
    GLOBAL_BATCH_SIZE = batch_size_per_replica * strategy.num_replicas_in_sync

    train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(
        BUFFER_SIZE, seed=SEED).batch(GLOBAL_BATCH_SIZE)
    test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    with strategy.scope():
        # Set reduction to `none` so you can do the reduction yourself.
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.001)
        optimizer.build(model.trainable_variables)  # Keras 3: its slots cannot be made inside strategy.run
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)
    checkpoint_prefix = os.path.join(checkpoint_dir or tempfile.mkdtemp(), "ckpt")

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    losses = []
    for epoch in range(epochs):
        total_loss, num_batches = 0.0, 0
        for x in train_dist_dataset:
            step_loss = distributed_train_step(x)
            losses.append(float(step_loss))
            total_loss += step_loss
            num_batches += 1
        train_loss = total_loss / num_batches
        for x in test_dist_dataset:
            distributed_test_step(x)
        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)
        print(f"Epoch {epoch + 1}, Loss: {float(train_loss):.4f}, "
              f"Accuracy: {float(train_accuracy.result()) * 100:.2f}, Test Loss: {float(test_loss.result()):.4f}, "
              f"Test Accuracy: {float(test_accuracy.result()) * 100:.2f}")
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    return losses


def split_cpu(replicas: int) -> List[str]:
    """`replicas` logical CPU devices for MirroredStrategy on a machine without GPUs (with
    `tf.distribute.ReductionToOneDevice()`: their memory is one)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    return [f"/cpu:{i}" for i in range(replicas)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--cpu_replicas", type=int, default=0, help="split the CPU into N replicas (0: all GPUs)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--num_train", type=int, default=2048, help="train examples")
    parser.add_argument("--num_test", type=int, default=512, help="test examples")
    args = parser.parse_args()
    sizes = {"epochs": args.epochs, "num_train": args.num_train, "num_test": args.num_test}
    if args.cpu_replicas:
        main(split_cpu(args.cpu_replicas), cross_device_ops=tf.distribute.ReductionToOneDevice(), **sizes)
    else:
        main(**sizes)
