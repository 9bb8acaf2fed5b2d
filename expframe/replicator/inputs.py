"""Distributed input whose position can be checkpointed.

`tf.distribute`'s own distributed iterators are not trackable, so a run could
not resume on the exact next batch. Here each worker keeps ONE plain `tf.data`
iterator (checkpointable) over the dataset that `input_fn` builds for it. Its
elements are stacked groups of the batches that the worker's local replicas
consume, in the same order that `distribute_datasets_from_function` would hand
them out (replica i of a worker takes the i-th of each group of consecutive
batches); each replica gets its slice through
`experimental_distribute_values_from_function`.
"""

from typing import Any, Callable

import tensorflow as tf


class DistributedInput:
    """Iterable over per-replica batches; `iter()` gives a checkpointable iterator."""

    def __init__(self, strategy: tf.distribute.Strategy, input_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
                 num_workers: int, worker_index: int):
        self._strategy = strategy
        self._local = strategy.num_replicas_in_sync // num_workers
        context = tf.distribute.InputContext(
            num_input_pipelines=num_workers, input_pipeline_id=worker_index,
            num_replicas_in_sync=strategy.num_replicas_in_sync)
        with tf.device("/cpu:0"):
            dataset = input_fn(context)
            if not isinstance(dataset, tf.data.Dataset):
                raise TypeError(f"input_fn must return a tf.data.Dataset, got {type(dataset).__name__}.")
            if self._local > 1:
                dataset = dataset.batch(self._local, drop_remainder=True)
            self.dataset = dataset.prefetch(tf.data.AUTOTUNE)
        self.element_spec = dataset.element_spec

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self._strategy, self.plain_iterator(), self._local)

    def plain_iterator(self):
        """A plain (checkpointable) tf.data iterator over the stacked batches, for
        `Replicator.next_from` inside a tf.function: unlike a new DistributedIterator
        (a tf.Module), a new plain iterator of the same element spec does not retrace."""
        with tf.device("/cpu:0"):
            return iter(self.dataset)


def per_replica(strategy, stacked, local):
    """Per-replica values from one element of stacked batches (`local` per worker)."""
    def slice_for(ctx):
        if local == 1:
            return stacked
        i = ctx.replica_id_in_sync_group % local
        return tf.nest.map_structure(lambda t: t[i], stacked)

    return strategy.experimental_distribute_values_from_function(slice_for)


class DistributedIterator(tf.Module):
    """`next()` returns per-replica values, eagerly or inside a `tf.function`.

    Put it (or its `.iterator`) in a `tf.train.Checkpoint` to save the data position.
    """

    def __init__(self, strategy, iterator, local_replicas):
        super().__init__(name="distributed_iterator")
        self._strategy = strategy
        self._local = local_replicas
        self.iterator = iterator  # a plain tf.data iterator (DistributedInput.plain_iterator)

    def get_next(self) -> Any:
        """The next batch for every replica (a PerReplica structure)."""
        return per_replica(self._strategy, next(self.iterator), self._local)

    def __next__(self):
        return self.get_next()

    def __iter__(self):
        return self
