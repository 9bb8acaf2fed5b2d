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

Served by the tf.data service (expframe/replicator/data_service.py), a pipeline is
split further, by whole steps: `ctx.step_shard` = (k, K, L) asks for the steps k, k + K,
k + 2K, ... of its stream (L examples per step), which shard k of the service prepares;
the trainer takes one step from each shard in turn, so the stream it reads is the
same as without the service. `positions` does it by index; `in_step_shard` filters a
stream of (position, ...) pairs before anything is decoded.

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


def _step_shard(ctx):
    """(k, K, L) as ints if the pipeline is shard k of K of a tf.data service, else None."""
    shard = getattr(ctx, "step_shard", None) if ctx is not None else None
    if shard is None:
        return None
    ctx.step_shard_read = True  # the input_fn honoured it (checked by DistributedInput)
    return tuple(int(v) for v in shard)


def positions(ctx: Optional[tf.distribute.InputContext], start: int) -> tf.data.Dataset:
    """int64 global positions of this pipeline: start + w, start + w + W, ... forever
    (only its step shard's, when `ctx.step_shard` is set: see the module docstring)."""
    w, num = (ctx.input_pipeline_id, ctx.num_input_pipelines) if ctx is not None else (0, 1)
    shard = _step_shard(ctx)
    if shard is None:
        return tf.data.Dataset.counter(start + w, num, dtype=tf.int64)
    k, shards, per_step = shard
    # The j-th position of shard k: step j // L of the shard is the pipeline's step
    # (j // L) * K + k, and within it example j % L.
    return tf.data.Dataset.counter(0, dtype=tf.int64).map(
        lambda j: start + w + ((j // per_step * shards + k) * per_step + j % per_step) * num)


def in_step_shard(ctx: Optional[tf.distribute.InputContext], start: int, stream: tf.data.Dataset) -> tf.data.Dataset:
    """`stream` (elements whose first component is the global position, as `positions`
    gives them from `start`) without the steps of other shards, when `ctx.step_shard`
    is set; else `stream` itself. Filtered before anything is parsed or decoded."""
    shard = _step_shard(ctx)
    if shard is None:
        return stream
    w, num = ctx.input_pipeline_id, ctx.num_input_pipelines
    k, shards, per_step = shard
    return stream.filter(lambda position, *_: ((position - start - w) // num // per_step) % shards == k)


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
