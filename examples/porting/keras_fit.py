"""The original of docs/porting.md's second port: a Keras program that compiles a model and
calls `fit`, with callbacks, under `MirroredStrategy`, on the project's shapes images.

`build_model` is the whole of what its port (keras_fit.gin, through KerasModelTask) takes
from it: the model and its `compile`. `main` seeds the shuffle (`seed=SEED`, with
`keras.utils.set_random_seed`), and can train unshuffled, so that runs can be compared
step by step (docs/porting.md says why unshuffled).

    python examples/porting/keras_fit.py --cpu_replicas=2 --epochs=2
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
BATCH_SIZE = 64  # over all replicas
EPOCHS = 10


def build_model() -> keras.Model:
    """A small CNN with L2 regularisers, compiled: SGD with momentum, the
    cross-entropy of its logits, accuracy."""
    regularizer = keras.regularizers.L2(1e-4)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main(devices: Optional[Sequence[str]] = None, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
         steps_per_epoch: Optional[int] = None, num_train: int = 2048, num_test: int = 512,
         log_dir: Optional[str] = None, shuffle: bool = True,
         callbacks: Sequence[keras.callbacks.Callback] = (),
         cross_device_ops: Optional[tf.distribute.CrossDeviceOps] = None) -> keras.callbacks.History:
    """Trains with `fit` and returns its History (`steps_per_epoch` None: one pass over the
    train data; `shuffle` False: the examples in their order; `callbacks`: more of them)."""
    keras.utils.set_random_seed(SEED)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    with strategy.scope():
        model = build_model()

    (train_images, train_labels), (test_images, test_labels) = load_data(num_train, num_test)
    # Endless, reshuffled on every pass; `steps_per_epoch` says where an epoch ends.
    train = tf.data.Dataset.from_tensor_slices((train_images / np.float32(255), train_labels))
    if shuffle:
        train = train.shuffle(len(train_labels), seed=SEED)
    train = train.repeat().batch(batch_size)
    test = tf.data.Dataset.from_tensor_slices((test_images / np.float32(255), test_labels)).batch(batch_size)

    log_dir = log_dir or tempfile.mkdtemp()
    return model.fit(train, epochs=epochs, steps_per_epoch=steps_per_epoch or len(train_labels) // batch_size,
                     validation_data=test, verbose=2, callbacks=[
        keras.callbacks.ModelCheckpoint(os.path.join(log_dir, "ckpt-{epoch}.weights.h5"), save_weights_only=True),
        keras.callbacks.TensorBoard(log_dir),
        keras.callbacks.CSVLogger(os.path.join(log_dir, "history.csv")), *callbacks])


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
