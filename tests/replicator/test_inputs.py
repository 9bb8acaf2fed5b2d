"""Distributed input: its data position (a few bytes), resumed at any replica count."""

import glob
import os

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.data import order
from expframe.replicator.inputs import DistributedInput, InputContext
from tests import support

N = 24           # examples in the toy dataset
GLOBAL_BATCH = 8


def indexed_input(ctx):
    """Index-based: starts at ctx.start_example, a new permutation of the N ids every epoch."""
    per_replica = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
    positions = order.positions(ctx, order.start_example(ctx)).batch(per_replica, drop_remainder=True)
    return positions.map(lambda p: {"id": order.shuffled_index(p, N, 0), "position": p})


def plain_input(ctx):
    """Ignores ctx.start_example: a shuffle buffer over the ids, every pipeline alike, sharded."""
    ids = tf.data.Dataset.range(N).shuffle(N, seed=1, reshuffle_each_iteration=True).repeat()
    ids = ids.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ids.batch(ctx.get_per_replica_batch_size(GLOBAL_BATCH), drop_remainder=True).map(lambda i: {"id": i})


def global_batches(rep, iterator, steps):
    """The ids of each global batch, replica by replica."""
    return [np.concatenate([np.asarray(t) for t in rep.local_results(next(iterator)["id"])]) for _ in range(steps)]


class InputPositionTest(support.TestCase):

    def test_the_same_global_batches_on_any_replica_count(self):
        reference = global_batches(xf.Replicator("cpu", 1), iter(xf.Replicator("cpu", 1).distribute(
            indexed_input, GLOBAL_BATCH)), 5)
        self.assertEqual(sorted(np.concatenate(reference[:3])), list(range(N)))
        for n in (2, 4):
            rep = xf.Replicator("cpu", n)
            got = global_batches(rep, iter(rep.distribute(indexed_input, GLOBAL_BATCH)), 5)
            np.testing.assert_array_equal(np.stack(got), np.stack(reference), err_msg=f"{n} replicas")

    def test_each_worker_reads_its_share(self):
        # Two workers of one replica each, simulated in one process: together they read
        # exactly the global batches of one replica, none twice.
        reference = global_batches(xf.Replicator("cpu", 1), iter(xf.Replicator("cpu", 1).distribute(
            indexed_input, GLOBAL_BATCH)), 4)
        strategy = xf.Replicator("cpu", 2).strategy
        shares = []
        for w in range(2):
            source = DistributedInput(strategy, indexed_input, num_workers=2, worker_index=w)
            shares.append([b["id"].numpy() for b in source.dataset.take(4)])
        for step in range(4):
            self.assertCountEqual(np.concatenate([shares[0][step], shares[1][step]]), reference[step])

    @parameterized.parameters(1, 2)
    def test_position_counts_what_the_steps_took(self, n):
        rep = xf.Replicator("cpu", n)
        iterator = iter(rep.distribute(indexed_input, GLOBAL_BATCH))
        next(iterator), next(iterator)

        @tf.function
        def three_steps(it):
            total = tf.constant(0.0)
            for _ in tf.range(3):
                total += rep.reduce(rep.run(lambda b: tf.cast(tf.reduce_sum(b["id"]), tf.float32), next(it)), "sum")
            return total

        three_steps(iterator)
        self.assertEqual(iterator.position.values(), (5, 5 * GLOBAL_BATCH, n))
        self.assertTrue(iterator.index_based)

    def _checkpoint(self, iterator):
        prefix = tf.train.Checkpoint(data=iterator.position).write(os.path.join(self.get_temp_dir(), "position"))
        return prefix, sum(os.path.getsize(p) for p in glob.glob(prefix + ".*"))

    @parameterized.parameters((2, 4), (2, 1), (4, 2))
    def test_resume_on_another_replica_count(self, before, after):
        rep = xf.Replicator("cpu", before)
        iterator = iter(rep.distribute(indexed_input, GLOBAL_BATCH))
        global_batches(rep, iterator, 3)
        prefix, size = self._checkpoint(iterator)
        self.assertLess(size, 2_000)  # three int64 and the checkpoint's index, nothing else
        uninterrupted = global_batches(rep, iterator, 2)

        rep = xf.Replicator("cpu", after)
        resumed = iter(rep.distribute(indexed_input, GLOBAL_BATCH))
        tf.train.Checkpoint(data=resumed.position).read(prefix).assert_consumed()
        message = resumed.restart()
        self.assertEqual(message, f"data position carried over: 3 global batches, {3 * GLOBAL_BATCH} examples "
                                  f"consumed (counted on {before} replicas, continuing on {after}); the input "
                                  f"restarts at global example {3 * GLOBAL_BATCH} (index-based: nothing is read twice)")
        np.testing.assert_array_equal(np.stack(global_batches(rep, resumed, 2)), np.stack(uninterrupted))
        self.assertEqual(resumed.position.values(), (5, 5 * GLOBAL_BATCH, after))

    def test_an_input_fn_that_ignores_the_position_is_re_derived(self):
        rep = xf.Replicator("cpu", 2)
        iterator = iter(rep.distribute(plain_input, GLOBAL_BATCH))
        self.assertFalse(iterator.index_based)
        global_batches(rep, iterator, 4)
        prefix, _ = self._checkpoint(iterator)
        uninterrupted = global_batches(rep, iterator, 3)
        resumed = iter(rep.distribute(plain_input, GLOBAL_BATCH))
        tf.train.Checkpoint(data=resumed.position).read(prefix).assert_consumed()
        self.assertEqual(resumed.restart(), "data position re-derived: 4 global batches, 32 examples consumed; "
                         "input_fn does not read ctx.start_example, so it restarts from its beginning and skips "
                         "the 4 batches already consumed")
        np.testing.assert_array_equal(np.stack(global_batches(rep, resumed, 3)), np.stack(uninterrupted))

    def test_sub_batches_are_not_taken_for_examples(self):
        # Elements of 2 sub-batches each: not one global batch of examples, so the
        # position cannot be an example index; it falls back to skipping batches.
        def sub_batches(ctx):
            return indexed_input(ctx).batch(2, drop_remainder=True)
        rep = xf.Replicator("cpu", 2)
        self.assertFalse(iter(rep.distribute(sub_batches, GLOBAL_BATCH)).index_based)

    def test_context(self):
        ctx = InputContext(2, 1, 4, start_example=96)
        self.assertFalse(ctx.start_read)
        self.assertEqual((ctx.start_example, ctx.start_read), (96, True))
        self.assertEqual(ctx.get_per_replica_batch_size(32), 8)
        self.assertEqual(ctx.global_batch_size, 32)
        self.assertEqual(order.start_example(tf.distribute.InputContext()), 0)
