"""Gin-configurable input functions for tasks: `fn(split, ctx, batch_size, training, seed,
deterministic) -> tf.data.Dataset` of {"image", "label", "id"} batches for one input pipeline.

Sharding: every pipeline shuffles the same way (same seed), then keeps every
`num_input_pipelines`-th example. So each example of an epoch is read by exactly
one worker, and a global step sees the same examples whether its replicas sit on
one host or several.
"""

from typing import Optional

import gin
import tensorflow as tf

from expframe.errors import ConfigError

_SHUFFLE_BUFFER = 20_000


def _finish(dataset, ctx, batch_size, training, seed):
    if training:
        dataset = dataset.shuffle(_SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=True).repeat()
    dataset = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    # Eval keeps the partial last batch: the trainer pads it (expframe/data/masked.py).
    return dataset.batch(batch_size, drop_remainder=training)


@gin.configurable
def shapes_input(split: str, ctx: tf.distribute.InputContext, batch_size: int, training: bool,
                 seed: int = 0, deterministic: bool = False, image_size: int = 32,
                 data_dir: Optional[str] = None, num_train: Optional[int] = None,
                 num_test: Optional[int] = None, standardize: bool = True) -> tf.data.Dataset:
    """The offline `shapes` dataset (generated locally on first use).

    Args (bindable): image_size (32 or 64), data_dir (TFDS data dir; default
    $TFDS_DATA_DIR or ~/tensorflow_datasets), num_train / num_test (smaller builds
    for tests), standardize (per-image zero mean and unit variance, which removes
    the random background colour and brightness; False scales to [-1, 1]).
    """
    del deterministic  # tf.data keeps element order by default; the seed fixes the shuffle.
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    if image_size not in (32, 64):
        raise ConfigError(f"shapes_input.image_size={image_size!r}: use 32 or 64.")
    dataset = shapes.load_shapes(split, size=image_size, data_dir=data_dir,
                                 num_train=num_train, num_test=num_test).cache()

    def prepare(example):
        image = tf.cast(example["image"], tf.float32)
        image = tf.image.per_image_standardization(image) if standardize else image / 127.5 - 1.0
        return {"image": image, "label": tf.cast(example["label"], tf.int32), "id": example["id"]}

    dataset = dataset.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    return _finish(dataset, ctx, batch_size, training, seed).prefetch(tf.data.AUTOTUNE)
