"""The porting examples' data: the project's `shapes` images (generated here, no download).

`load_data` stands in for `keras.datasets.fashion_mnist.load_data()` in the two
original programs (custom_loop.py, keras_fit.py). `shapes_arrays` is what their ports
read (custom_loop.gin, keras_fit.gin): the originals' own tf.data pipeline, made
endless and batched per replica, as an expframe dataset function.
"""

import functools
from typing import Tuple

import gin
import numpy as np
import tensorflow as tf

from expframe.data import shapes

Arrays = Tuple[Tuple[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]


@functools.lru_cache(maxsize=4)
def load_data(num_train: int = 2048, num_test: int = 512, size: int = 32) -> Arrays:
    """((train_images, train_labels), (test_images, test_labels)): uint8 [N, size, size, 3]
    images of 10 classes of shapes and int64 [N] labels, the same on every call."""
    train_images, train_labels, _ = shapes.generate("train", num_train, size)
    test_images, test_labels, _ = shapes.generate("test", num_test, size)
    return (train_images, train_labels), (test_images, test_labels)


@gin.configurable
def shapes_arrays(split: str, ctx: tf.distribute.InputContext, batch_size: int, training: bool, seed: int = 0,
                  deterministic: bool = False, num_train: int = 2048, num_test: int = 512, size: int = 32,
                  shuffle: bool = True) -> tf.data.Dataset:
    """Batches of {"image": float32 [batch_size, size, size, 3] in [0, 1], "label": int64}.

    Training: the originals' `.shuffle(BUFFER_SIZE, seed=SEED)` over the whole split,
    `.repeat()`ed (an expframe train pipeline is endless: each pass is shuffled anew, in
    the order the originals' epochs see) and batched per replica with drop_remainder.
    With `shuffle` False, the examples in their order, pass after pass. Evaluation: one
    pass; the partial last batch is kept. Each input pipeline (one per worker) reads its
    own shard.
    """
    del deterministic  # the order is a function of the seed
    (train_images, train_labels), (test_images, test_labels) = load_data(num_train, num_test, size)
    images, labels = (train_images, train_labels) if split == "train" else (test_images, test_labels)
    dataset = tf.data.Dataset.from_tensor_slices({"image": images / np.float32(255), "label": labels})
    dataset = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    if training:
        if shuffle:
            dataset = dataset.shuffle(len(labels), seed=seed)
        return dataset.repeat().batch(batch_size, drop_remainder=True)
    return dataset.batch(batch_size)
