"""Distributed input whose position is a few bytes, at any replica count.

`tf.distribute`'s own distributed iterators are not trackable, so a run could not
resume on the exact next batch. Here each worker keeps ONE plain `tf.data` iterator
over the dataset that `input_fn` builds for it. Its elements are stacked groups of
the batches that the worker's local replicas consume, in the same order that
`distribute_datasets_from_function` would hand them out (replica i of a worker takes
the i-th of each group of consecutive batches); each replica gets its slice through
`experimental_distribute_values_from_function`.

The data position is not the tf.data iterator's state (that would hold its shuffle
and prefetch buffers: gigabytes per worker for ImageNet, and tied to the replica
count). It is `InputPosition`: how many global batches, and how many examples, the
steps have consumed, counted as they take their batches. On resume the input is
rebuilt at that position, in one of two ways:

- index-based: `input_fn` reads `ctx.start_example` (an `InputContext` here) and starts
  its stream at that global example, deciding by index what to read and never
  decoding what was consumed (expframe's datasets do; see expframe/data/order.py).
  This works at any replica and worker count and global batch size.
- re-derived: an `input_fn` that ignores `ctx.start_example` is rebuilt from its
  start and the consumed batches are skipped (read and dropped: exact when the
  pipeline's order is deterministic and each element is one global batch, slow for
  big datasets).
"""

from typing import Any, Callable, Optional, Tuple

import tensorflow as tf


class InputContext(tf.distribute.InputContext):
    """`tf.distribute.InputContext` plus where the input starts.

    Attributes:
      start_example: global examples the run has consumed (over all replicas and
        workers, since step 0): an index-based input_fn starts its stream there.
      global_batch_size: the value passed to `get_per_replica_batch_size`, if called.
      step_shard: (k, K, L) when shard k of K of a tf.data service prepares this
        pipeline: only the steps k, k + K, ... of its stream, L examples per step
        (expframe.data.order.positions honours it); else None.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1, start_example: int = 0,
                 step_shard: Optional[Tuple[int, int, int]] = None):
        super().__init__(num_input_pipelines, input_pipeline_id, num_replicas_in_sync)
        self._start_example = int(start_example)
        self.start_read = False
        self.global_batch_size = None
        self.step_shard = step_shard
        self.step_shard_read = False

    @property
    def start_example(self) -> int:
        self.start_read = True
        return self._start_example

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        self.global_batch_size = global_batch_size
        return super().get_per_replica_batch_size(global_batch_size)


class InputPosition(tf.Module):
    """How far the train steps have read: the checkpointed data position.

    Variables (int64, the same on every replica and worker): `batches` (global batches
    taken), `examples` (global examples taken) and `replicas` (the replica count of
    the run that counted them, for the resume message).
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        super().__init__(name="input_position")
        with strategy.scope(), tf.device("/cpu:0"):
            def counter(name, value=0):
                return tf.Variable(value, dtype=tf.int64, trainable=False, name=name,
                                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.batches = counter("batches")
            self.examples = counter("examples")
            self.replicas = counter("replicas", strategy.num_replicas_in_sync)

    def advance(self, examples: int) -> None:
        """One global batch of `examples` examples taken (eagerly or inside a tf.function)."""
        self.batches.assign_add(1)
        self.examples.assign_add(examples)

    def values(self) -> Tuple[int, int, int]:
        """(batches, examples, replicas) as Python ints."""
        return int(self.batches.numpy()), int(self.examples.numpy()), int(self.replicas.numpy())


class DistributedInput:
    """Iterable over per-replica batches; `iter()` gives a `DistributedIterator`."""

    def __init__(self, strategy: tf.distribute.Strategy,
                 input_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
                 num_workers: int, worker_index: int, service=None):
        self._strategy = strategy
        self._input_fn = input_fn
        self._num_workers = num_workers
        self._worker_index = worker_index
        self._local = strategy.num_replicas_in_sync // num_workers
        self._service = None
        self.dataset, ctx = self._build(0)
        self.element_spec = self.dataset.element_spec
        self.examples_per_batch = self._global_batch(ctx)
        #: Whether input_fn starts where it is told (index-based resume).
        self.index_based = ctx.start_read and self.examples_per_batch is not None
        if service is not None:
            service.check_input(self.index_based, self.index_based and self._served_ok())
            self._service = service
            self.dataset = self._build(0)[0]

    def _stacked(self, ctx: InputContext) -> tf.data.Dataset:
        dataset = self._input_fn(ctx)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"input_fn must return a tf.data.Dataset, got {type(dataset).__name__}.")
        self._per_input_spec = dataset.element_spec
        if self._local > 1:
            dataset = dataset.batch(self._local, drop_remainder=True)
        return dataset

    def _context(self, start_example: int, step_shard=None) -> InputContext:
        return InputContext(self._num_workers, self._worker_index, self._strategy.num_replicas_in_sync,
                            start_example, step_shard)

    def _served_ok(self) -> bool:
        """Whether input_fn honours `ctx.step_shard` (builds, never runs, one shard)."""
        ctx = self._context(0, (0, 2, self.examples_per_batch // self._num_workers))
        with tf.device("/cpu:0"):
            self._stacked(ctx)
        return ctx.step_shard_read

    def _build(self, start_example: int) -> Tuple[tf.data.Dataset, InputContext]:
        with tf.device("/cpu:0"):
            if self._service is None:
                ctx = self._context(start_example)
                return self._stacked(ctx).prefetch(tf.data.AUTOTUNE), ctx
            per_step = self.examples_per_batch // self._num_workers
            contexts = [self._context(start_example, (k, self._service.shards, per_step))
                        for k in range(self._service.shards)]
            dataset = self._service.serve([self._stacked(ctx) for ctx in contexts])
            return dataset.prefetch(tf.data.AUTOTUNE), contexts[0]

    def _global_batch(self, ctx: InputContext) -> Optional[int]:
        """Examples in one global batch: from the global batch size input_fn asked the
        per-replica share of, if its batches have that many examples; else None."""
        leaves = tf.nest.flatten(self._per_input_spec)
        rank_ok = leaves and all(s.shape.rank for s in leaves)
        per_replica = leaves[0].shape[0] if rank_ok else None
        if ctx.global_batch_size is None or per_replica is None:
            return None
        if per_replica * self._strategy.num_replicas_in_sync != ctx.global_batch_size:
            return None  # e.g. several sub-batches per element: not one batch of examples
        return int(ctx.global_batch_size)

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self)

    def plain_iterator(self):
        """A plain tf.data iterator over the stacked batches, for `Replicator.next_from`
        inside a tf.function: unlike a new DistributedIterator (a tf.Module), a new
        plain iterator of the same element spec does not retrace."""
        with tf.device("/cpu:0"):
            return iter(self.dataset)

    def dataset_at(self, batches: int, examples: int) -> Tuple[tf.data.Dataset, bool]:
        """The stacked batches from a position on, and whether by index (else by skipping).

        Built anew by input_fn either way: a second iterator over `self.dataset` would
        see another order where the pipeline reshuffles on each iteration."""
        if self.index_based:
            return self._build(examples)[0], True
        dataset, _ = self._build(0)
        with tf.device("/cpu:0"):
            return dataset.skip(batches), False

    @property
    def local_replicas(self) -> int:
        return self._local

    @property
    def strategy(self) -> tf.distribute.Strategy:
        return self._strategy


def per_replica(strategy, stacked, local):
    """Per-replica values from one element of stacked batches (`local` per worker)."""
    def slice_for(ctx):
        if local == 1:
            return stacked
        i = ctx.replica_id_in_sync_group % local
        return tf.nest.map_structure(lambda t: t[i], stacked)

    return strategy.experimental_distribute_values_from_function(slice_for)


class DistributedIterator(tf.Module):
    """`next()` returns per-replica values, eagerly or inside a `tf.function`, and counts
    what it hands out in `position` (an `InputPosition`).

    To resume: restore `position` (e.g. from a `tf.train.Checkpoint(data=it.position)`),
    then call `restart()` before the first `next()` (and before tracing a function
    that takes this iterator).
    """

    def __init__(self, source: DistributedInput):
        super().__init__(name="distributed_iterator")
        self._source = source
        self.position = InputPosition(source.strategy)
        with tf.init_scope(), tf.device("/cpu:0"):
            self._iterator = iter(source.dataset)  # prefetching starts at the first next()

    @property
    def iterator(self):
        """The underlying plain tf.data iterator."""
        return self._iterator

    @property
    def index_based(self) -> bool:
        return self._source.index_based

    def restart(self) -> str:
        """Rebuilds the input at `position` (restored from a checkpoint, or set) and
        returns one line saying where and how it resumes."""
        batches, examples, replicas = self.position.values()
        dataset, by_index = self._source.dataset_at(batches, examples)
        with tf.init_scope(), tf.device("/cpu:0"):
            self._iterator = iter(dataset)
        now = self._source.strategy.num_replicas_in_sync
        self.position.replicas.assign(now)
        moved = f" (counted on {replicas} replicas, continuing on {now})" if replicas != now else ""
        where = f"{batches:,} global batches, {examples:,} examples consumed{moved}"
        if by_index:
            return (f"data position carried over: {where}; the input restarts at global example {examples:,} "
                    "(index-based: nothing is read twice)")
        return (f"data position re-derived: {where}; input_fn does not read ctx.start_example, so it restarts "
                f"from its beginning and skips the {batches:,} batches already consumed")

    def get_next(self) -> Any:
        """The next batch for every replica (a PerReplica structure)."""
        stacked = next(self.iterator)
        self.position.advance(self._source.examples_per_batch or 0)
        return per_replica(self._source.strategy, stacked, self._source.local_replicas)

    def __next__(self):
        return self.get_next()

    def __iter__(self):
        return self
