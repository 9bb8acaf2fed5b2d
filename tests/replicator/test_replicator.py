"""Replicator: targets, clear errors, distributed input, several sizes in one process."""

import json
import os
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.replicator import targets
from tests import support


class ReplicatorTest(support.TestCase):

    def test_sizes_one_after_another(self):
        for n in (1, 2, 4, 3, 8, 2):
            self.assertEqual(xf.Replicator("cpu", n).num_replicas, n)

    def test_more_replicas_than_the_split_is_a_clear_error(self):
        with self.assertRaisesRegex(xf.ConfigError, "num_replicas=9 .* already started with 8 logical CPU.*EXPFRAME_CPU_DEVICES=9"):
            xf.Replicator("cpu", 9)

    @parameterized.parameters(
        (dict(target="tpuu"), r"Replicator.target='tpuu' is not a known target; use one of 'cpu'"),
        (dict(target="gpu"), r"target='gpu' but TensorFlow sees no GPU"),
        (dict(target="cpu", num_replicas=0), r"num_replicas=0 must be a positive integer"),
        (dict(target="cpu", num_replicas="2"), r"num_replicas='2' must be a positive integer"),
    )
    def test_bad_targets(self, kwargs, pattern):
        with self.assertRaisesRegex(xf.ConfigError, pattern):
            xf.Replicator(**kwargs)

    def test_tpu_without_hardware(self):
        with self.assertRaisesRegex(xf.ConfigError, "target='tpu' but no TPU was found.*use Replicator.target='cpu'"):
            xf.Replicator("tpu")

    def test_auto_picks_cpu_here(self):
        self.assertEqual(xf.Replicator("auto").target, "cpu")

    def test_batch_not_divisible(self):
        rep = xf.Replicator("cpu", 4)
        with self.assertRaisesRegex(xf.ConfigError, r"Trainer.global_batch_size=30 is not divisible by the 4 replicas.*28 or 32"):
            rep.distribute(lambda ctx: tf.data.Dataset.range(4), global_batch_size=30)
        self.assertEqual(rep.check_global_batch(32), 8)

    @parameterized.parameters(
        ("not json", "TF_CONFIG is not a valid cluster description"),
        (json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}), "IndexError"),
        (json.dumps({"cluster": {"worker": ["127.0.0.1:notaport"]}, "task": {"type": "worker", "index": 0}}), "invalid literal"),
    )
    def test_bad_tf_config(self, value, pattern):
        with mock.patch.dict(os.environ, {"TF_CONFIG": value}), self.assertRaisesRegex(xf.ConfigError, pattern):
            targets.cluster_spec_from_env()

    def test_cluster_target_without_tf_config(self):
        with mock.patch.dict(os.environ, {"TF_CONFIG": ""}), self.assertRaisesRegex(
                xf.ConfigError, "TF_CONFIG is not set; start the run with `python -m expframe.launch"):
            xf.Replicator("multi_worker")

    @parameterized.named_parameters(*support.named_replicators())
    def test_distribute_gives_consecutive_batches_and_resumes(self, target, n):
        rep = support.replicator(target, n)
        per_replica = rep.check_global_batch(8)

        def input_fn(ctx):
            self.assertEqual(ctx.num_replicas_in_sync, n)
            return tf.data.Dataset.range(1000).batch(ctx.get_per_replica_batch_size(8))

        it = iter(rep.distribute(input_fn, global_batch_size=8))
        step = tf.function(lambda b: rep.run(lambda x: x, b))
        first = np.concatenate(rep.local_results(step(next(it))))
        np.testing.assert_array_equal(first, np.arange(8))
        path = tf.train.Checkpoint(data=it).save(os.path.join(self.get_temp_dir(), "data"))
        second = np.concatenate(rep.local_results(step(next(it))))
        np.testing.assert_array_equal(second, np.arange(8, 16))
        fresh = iter(rep.distribute(input_fn, global_batch_size=8))
        tf.train.Checkpoint(data=fresh).restore(path).assert_consumed()
        # Inside a tf.function too: next() on the iterator in the traced loop.
        @tf.function
        def two_steps(iterator):
            a = rep.run(lambda x: x, iterator.get_next())
            b = rep.run(lambda x: x, iterator.get_next())
            return a, b
        a, b = two_steps(fresh)
        np.testing.assert_array_equal(np.concatenate(rep.local_results(a)), np.arange(8, 16))
        np.testing.assert_array_equal(np.concatenate(rep.local_results(b)), np.arange(16, 24))
        self.assertEqual(per_replica, 8 // n)
