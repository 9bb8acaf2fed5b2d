"""The tutorial's dataset: y = sin(2 x.a) + x.b + noise, for x drawn from N(0, I)."""

import gin
import numpy as np
import tensorflow as tf

from expframe.data import order


@gin.configurable
def sine_waves(split: str, ctx: tf.distribute.InputContext, batch_size: int, training: bool, seed: int = 0,
               deterministic: bool = False, dim: int = 8, num_train: int = 4096, num_test: int = 512,
               noise: float = 0.05) -> tf.data.Dataset:
    """Batches of {"x": [batch_size, dim], "y": [batch_size]} for this input pipeline."""
    del deterministic  # the order below is a function of the seed and the position alone
    rng = np.random.default_rng(1234)  # the data itself is fixed; `seed` only orders it
    a, b = rng.normal(size=(2, dim)) / np.sqrt(dim)
    x = rng.normal(size=(num_train + num_test, dim))
    y = np.sin(2 * x @ a) + x @ b + noise * rng.normal(size=len(x))
    first, n = (0, num_train) if split == "train" else (num_train, num_test)
    x, y = tf.constant(x[first:first + n], tf.float32), tf.constant(y[first:first + n], tf.float32)
    if training:  # endless, reshuffled every epoch, from the run's data position (resume)
        positions = order.positions(ctx, order.start_example(ctx)).batch(batch_size, drop_remainder=True)
        index = positions.map(lambda p: order.shuffled_index(p, n, seed))
    else:  # one pass, every example once; the partial last batch is kept
        index = tf.data.Dataset.range(ctx.input_pipeline_id, n, ctx.num_input_pipelines).batch(batch_size)
    return index.map(lambda i: {"x": tf.gather(x, i), "y": tf.gather(y, i)})
