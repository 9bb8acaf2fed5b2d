"""The global example order of expframe's train pipelines, and each pipeline's share.

A train pipeline here keeps no state worth saving: its order is a pure function of
the seed and the global position. Position p = 0, 1, 2, ... counts examples over the
whole run, across epochs and over all replicas and workers. Global batch s of B
examples, started at position P, holds positions P + sB .. P + (s+1)B - 1, and input
pipeline w of W takes the positions P + w + kW (k = 0, 1, ...), which it batches b
at a time per replica; `Replicator.distribute` deals each worker's consecutive
batches to its replicas. So a global batch holds the same examples whatever the
number of workers and replicas, and a run resumes by rebuilding its pipelines at P =
the examples consumed (`ctx.start_example`, see expframe/replicator/inputs.py),
reading nothing twice and decoding nothing it skips.

In-memory datasets (`shapes`, ImageNet mock data) map position p to example
`permutation_e(p mod N)` of epoch e = p div N: a stateless pseudo-random permutation
of the split per epoch (`tf.random.experimental.index_shuffle`), so every example
appears once per epoch, in a new order each epoch. Datasets on disk read records in
a seekable order instead (expframe/data/records.py). Augmentation draws its
randomness from `example_seed(seed, p)`, so it too depends only on the position.
"""

import random
from typing import Optional

import tensorflow as tf

_SEED_WORD = 498_247_692  # the first seed word index_shuffle uses


def start_example(ctx: Optional[tf.distribute.InputContext]) -> int:
    """Where this pipeline's stream starts: `ctx.start_example`, 0 for a plain context."""
    return int(getattr(ctx, "start_example", 0)) if ctx is not None else 0


def resolve_seed(seed: Optional[int]) -> int:
    """The seed, or a random one if None (the order is then new on every (re)start)."""
    return random.SystemRandom().randrange(2**31) if seed is None else int(seed)


def positions(ctx: Optional[tf.distribute.InputContext], start: int) -> tf.data.Dataset:
    """int64 global positions of this pipeline: start + w, start + w + W, ... forever."""
    w, num = (ctx.input_pipeline_id, ctx.num_input_pipelines) if ctx is not None else (0, 1)
    return tf.data.Dataset.counter(start + w, num, dtype=tf.int64)


def shuffled_index(position: tf.Tensor, num_examples: int, seed: int) -> tf.Tensor:
    """The example (0 .. num_examples - 1) at global position(s) `position` (int64, any shape).

    Epoch e = position div N is a permutation of the N examples seeded by (seed, e).
    """
    position = tf.convert_to_tensor(position, tf.int64)
    n = tf.constant(num_examples, tf.int64)
    epoch, index = tf.reshape(position // n, [-1]), tf.reshape(position % n, [-1])
    # RandomIndexShuffle takes a 3-word seed per index (tf.random.experimental.index_shuffle
    # pads a 2-word seed with the same first word, but mishandles a batch of seeds).
    seeds = tf.stack([tf.fill(tf.shape(epoch), tf.constant(_SEED_WORD, tf.int64)),
                      tf.fill(tf.shape(epoch), tf.constant(seed, tf.int64)), epoch], axis=-1)
    flat = tf.raw_ops.RandomIndexShuffle(index=index, seed=seeds, max_index=tf.fill(tf.shape(index), n - 1),
                                         rounds=4)
    return tf.reshape(flat, tf.shape(position))


def example_seed(seed: int, position: tf.Tensor) -> tf.Tensor:
    """A stateless seed (int64 [2]) for the augmentation of the example at `position`."""
    return tf.stack([tf.constant(seed, tf.int64), tf.cast(position, tf.int64)])
