"""Gin-configurable input functions for tasks: `fn(split, ctx, batch_size, training, seed,
deterministic) -> tf.data.Dataset` of {"image", "label", "id"} batches for one input pipeline.

Training reads in the index-based global order of expframe/data/order.py: each epoch
is a fresh permutation of the split, pipeline w of W takes every W-th example of the
global stream from `ctx.start_example` on (the run's data position), so each example
of an epoch is read by exactly one worker, a global step sees the same examples
whether its replicas sit on one host or several, and a resumed run (at any replica
count) reads exactly the examples it would have read. Evaluation reads the split
once, in order, every W-th example per pipeline.
"""

import functools
from typing import Optional, Tuple

import gin
import numpy as np
import tensorflow as tf

from expframe.data import order, raw_images
from expframe.errors import ConfigError


@functools.lru_cache(maxsize=4)
def _in_memory(split: str, image_size: int, data_dir: Optional[str], num_train: Optional[int],
               num_test: Optional[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images uint8 [N, S, S, 3], labels int64 [N], ids int64 [N]) of a prepared shapes split."""
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    # Eagerly, also when the input_fn is traced (parameter_server builds per-worker
    # datasets inside a tf.function).
    with tf.init_scope():
        dataset = shapes.load_shapes(split, size=image_size, data_dir=data_dir, num_train=num_train,
                                     num_test=num_test)
        parts = list(dataset.batch(4096).as_numpy_iterator())
    return tuple(np.concatenate([p[k] for p in parts]) for k in ("image", "label", "id"))


def _dihedral(images: tf.Tensor, positions: tf.Tensor, seed: int) -> tf.Tensor:
    """Each image of a batch under one of the 8 symmetries of the square (rotations by
    multiples of 90 degrees, each with or without a flip), drawn from its position's
    `order.example_seed`: the same for an example wherever and whenever it is read."""
    draw = tf.map_fn(lambda p: tf.random.stateless_uniform([], order.example_seed(seed, p), maxval=8,
                                                           dtype=tf.int32),
                     positions, fn_output_signature=tf.int32)
    bit = [tf.reshape(tf.equal(draw // 2**i % 2, 1), [-1, 1, 1, 1]) for i in range(3)]
    images = tf.where(bit[0], tf.transpose(images, [0, 2, 1, 3]), images)
    images = tf.where(bit[1], tf.reverse(images, [1]), images)
    return tf.where(bit[2], tf.reverse(images, [2]), images)


def shapes_pixels(image: tf.Tensor, standardize: bool) -> tf.Tensor:
    """uint8 images (one [H, W, C] or a batch [N, H, W, C]) as float32 model inputs, each
    image on its own: standardized to zero mean and unit variance
    (`tf.image.per_image_standardization`), or with `standardize = False` scaled to [-1, 1]."""
    image = tf.cast(image, tf.float32)
    return tf.image.per_image_standardization(image) if standardize else image / 127.5 - 1.0


def shapes_eval_image(image: tf.Tensor, image_size: int = 32, standardize: bool = True) -> tf.Tensor:
    """One uint8 [H, W, 3] image of any size as `shapes_input`'s eval pipeline feeds the
    model: float32 [image_size, image_size, 3]. An image of another size is first resized
    to image_size (bilinear, antialiased); the dataset's own images never are."""
    size = tf.shape(image)[:2]
    image = tf.cond(tf.reduce_all(tf.equal(size, image_size)), lambda: tf.cast(image, tf.float32),
                    lambda: tf.image.resize(image, [image_size, image_size], method="bilinear", antialias=True))
    return shapes_pixels(tf.ensure_shape(image, [image_size, image_size, 3]), standardize)


def _prepare(image, label, ids, standardize):
    return {"image": shapes_pixels(image, standardize), "label": tf.cast(label, tf.int32), "id": ids}


@gin.configurable
def shapes_input(split: str, ctx: tf.distribute.InputContext, batch_size: int, training: bool,
                 seed: int = 0, deterministic: bool = False, image_size: int = 32,
                 data_dir: Optional[str] = None, num_train: Optional[int] = None,
                 num_test: Optional[int] = None, standardize: bool = True,
                 augment: bool = False) -> tf.data.Dataset:
    """The offline `shapes` dataset (generated locally on first use).

    Args (bindable): image_size (32 or 64), data_dir (TFDS data dir; default
    $TFDS_DATA_DIR or ~/tensorflow_datasets), num_train / num_test (smaller builds
    for tests), standardize (per-image zero mean and unit variance, which removes
    the random background colour and brightness; False scales to [-1, 1]), augment
    (training only, off by default: each example turned by a random multiple of 90
    degrees and flipped or not, drawn from its position; every shapes class is
    mirror-symmetric and drawn at a uniformly random angle and position, so these keep
    the label and the distribution of the images).
    """
    del deterministic  # both orders are deterministic: the seed fixes the permutations.
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    if image_size not in (32, 64):
        raise ConfigError(f"shapes_input.image_size={image_size!r}: use 32 or 64.")
    if not training:
        dataset = shapes.load_shapes(split, size=image_size, data_dir=data_dir,
                                     num_train=num_train, num_test=num_test).cache()
        dataset = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        dataset = dataset.map(lambda ex: _prepare(ex["image"], ex["label"], ex["id"], standardize),
                              num_parallel_calls=tf.data.AUTOTUNE)
        # Eval keeps the partial last batch: the trainer pads it (expframe/data/masked.py).
        return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)
    images, labels, ids = (tf.constant(a) for a in _in_memory(split, image_size, data_dir, num_train, num_test))
    num, seed = int(labels.shape[0]), order.resolve_seed(seed)

    def gather(positions):
        index = order.shuffled_index(positions, num, seed)
        batch = tf.gather(images, index)
        if augment:
            batch = _dihedral(batch, positions, seed)
        return _prepare(batch, tf.gather(labels, index), tf.gather(ids, index), standardize)

    dataset = order.positions(ctx, order.start_example(ctx)).batch(batch_size, drop_remainder=True)
    return dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def _shapes_raw_images(arguments) -> raw_images.RawImages:
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    size, standardize = arguments["image_size"], arguments["standardize"]

    def preprocess(image):
        return shapes_eval_image(image, size, standardize)

    return raw_images.RawImages(
        preprocess=preprocess, decode=lambda encoded: preprocess(raw_images.decode_image(encoded)),
        class_names=shapes.CLASS_NAMES)


raw_images.declare(shapes_input, _shapes_raw_images)
