"""Replicator: targets, clear errors, distributed input, several sizes in one process."""

import json
import os
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.replicator import collective_audit, targets
from tests import support


class ReplicatorTest(support.TestCase):

    def test_sizes_one_after_another(self):
        for n in (1, 2, 4, 3, 8, 2):
            self.assertEqual(xf.Replicator("cpu", n).num_replicas, n)

    def test_more_replicas_than_the_split_is_a_clear_error(self):
        with self.assertRaisesRegex(xf.ConfigError,
                                    "num_replicas=9 .* already started with 8 logical CPU.*EXPFRAME_CPU_DEVICES=9"):
            xf.Replicator("cpu", 9)

    def test_logical_cpu_devices_have_a_ceiling(self):
        """Beyond 64 logical CPU devices a binding is refused at once, naming it, unless
        EXPFRAME_CPU_DEVICES asks for that many (issue 18, item 9)."""
        with self.assertRaisesRegex(xf.ConfigError, r"^Replicator.num_replicas=65 on target 'cpu' asks for 65 "
                                    r"logical CPU devices, more than the ceiling of 64 .*use Replicator.num_replicas "
                                    r"<= 64, or set EXPFRAME_CPU_DEVICES=65"):
            xf.Replicator("cpu", 65)
        with self.assertRaisesRegex(xf.ConfigError, r"^Replicator.mesh_shape=\{'batch': 64, 'model': 64\} asks for "
                                    r"4096 logical CPU devices, more than the ceiling of 64 .*make the product of the "
                                    r"mesh axes <= 64, or set EXPFRAME_CPU_DEVICES=4096"):
            xf.Replicator("mesh", mesh_shape={"batch": 64, "model": 64})
        with mock.patch.dict(os.environ, {"EXPFRAME_CPU_DEVICES": "65"}):  # raised explicitly: past the ceiling
            with self.assertRaisesRegex(xf.ConfigError, "num_replicas=65 .* already started with 8 logical CPU"):
                xf.Replicator("cpu", 65)
        with mock.patch.dict(os.environ, {"EXPFRAME_CPU_DEVICES": "many"}):
            with self.assertRaisesRegex(xf.ConfigError, "EXPFRAME_CPU_DEVICES='many' must be a positive integer"):
                xf.Replicator("cpu", 2)

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

    def test_trace_steps_traces_once_for_run_steps(self):
        """run_experiment traces the step before it writes anything; the first host call
        reuses that trace instead of tracing again, and tracing reads no data."""
        rep = xf.Replicator("cpu", 2)
        it = iter(rep.distribute(lambda ctx: tf.data.Dataset.range(100).batch(2).map(
            lambda b: tf.cast(b, tf.float32)), global_batch_size=4))
        step = lambda batch: {"first": batch[0]}  # noqa: E731
        rep.trace_steps(step, it)
        loop = rep._step_loops[step]  # pylint: disable=protected-access
        self.assertEqual(loop.experimental_get_tracing_count(), 1)
        self.assertEqual(rep.run_steps(step, it, 2), {"first": 3.0})  # replicas start at 0 and 2, then 4 and 6
        self.assertEqual(rep.run_steps(step, it, 1), {"first": 9.0})
        self.assertEqual(loop.experimental_get_tracing_count(), 1)

    def test_a_one_step_host_call_has_no_step_loop_and_trains_as_the_looped_one(self):
        """Issue 61: a host call of one step runs the step without a `tf.range` loop around
        it (the loop costs a fixed time per call, as Keras fit knows). trace_steps(.., 1) traces that
        form and one-step calls reuse it; a longer call traces the looped form, which a
        one-step call then reuses. Both forms train to the same bits."""
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((24, 4)).astype("float32"), rng.standard_normal((24, 1)).astype("float32")

        def train(calls, trace=None):
            keras.utils.set_random_seed(0)
            rep = xf.Replicator("cpu", 2)
            with rep.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                          keras.layers.BatchNormalization(), keras.layers.Dense(1)])
                opt = xf.wrap_optimizer(keras.optimizers.SGD(0.1, momentum=0.9))
                opt.build(model.trainable_variables)

            def step(batch):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(batch[0], training=True) - batch[1]))
                opt.minimize(loss, model.trainable_variables, tape)
                return {"loss": loss}
            it = iter(rep.distribute(lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2), global_batch_size=4))
            if trace:
                rep.trace_steps(step, it, trace)
            losses = [rep.run_steps(step, it, n)["loss"] for n in calls]
            return rep, step, it, losses, [np.asarray(rep.local_results(v.value)[0]) for v in model.weights]

        def op_types(loop, it):
            graph = loop.get_concrete_function(it, tf.TensorSpec([], tf.int32)).graph
            return {op.type for op in graph.get_operations()}

        rep, step, it, one_step_losses, one_step_weights = train([1] * 6, trace=1)
        one_step = rep._one_steps[step]  # pylint: disable=protected-access
        self.assertNotIn(step, getattr(rep, "_step_loops", {}))  # pylint: disable=protected-access
        self.assertEqual(one_step.experimental_get_tracing_count(), 1)
        self.assertFalse({"While", "StatelessWhile"} & op_types(one_step, it))
        rep, step, it, looped_losses, looped_weights = train([2, 1, 2, 1], trace=2)
        looped = rep._step_loops[step]  # pylint: disable=protected-access
        self.assertNotIn(step, getattr(rep, "_one_steps", {}))  # pylint: disable=protected-access
        self.assertEqual(looped.experimental_get_tracing_count(), 1)
        self.assertTrue({"While", "StatelessWhile"} & op_types(looped, it))
        for a, b in zip(one_step_weights, looped_weights, strict=True):
            np.testing.assert_array_equal(a, b)
        self.assertAlmostEqual(looped_losses[0], (one_step_losses[0] + one_step_losses[1]) / 2, places=5)
        self.assertEqual(looped_losses[1], one_step_losses[2])

    def test_batch_not_divisible(self):
        rep = xf.Replicator("cpu", 4)
        with self.assertRaisesRegex(xf.ConfigError,
                                    r"Trainer.global_batch_size=30 is not divisible by the 4 replicas.*28 or 32"):
            rep.distribute(lambda ctx: tf.data.Dataset.range(4), global_batch_size=30)
        self.assertEqual(rep.check_global_batch(32), 8)

    @parameterized.parameters(
        ("not json", "TF_CONFIG is not a valid cluster description"),
        (json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}), "IndexError"),
        (json.dumps({"cluster": {"worker": ["127.0.0.1:notaport"]}, "task": {"type": "worker", "index": 0}}),
         "invalid literal"),
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


def _moments_per_replica(x, n):
    parts = np.split(x, n)
    return np.mean([p.mean(0) for p in parts], 0), np.mean([p.var(0) for p in parts], 0)


class StatisticsTest(support.TestCase):
    """Plain keras BatchNormalization in Replicator.scope(): one copy of its moving statistics."""

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_plain_batch_norm_keeps_one_copy_of_its_statistics(self, target, n):
        rep = support.replicator(target, n)
        rng = np.random.default_rng(0)
        # Each replica's shard has its own mean, so per-replica statistics would differ.
        steps = [rng.normal(size=(8, 3)).astype(np.float32) + np.repeat(np.arange(n), 8 // n)[:, None]
                 for _ in range(3)]
        momentum = 0.5

        def trained(layer):
            step = tf.function(lambda a: rep.run(lambda v: layer(v, training=True), a))
            for x in steps:
                step(support.per_replica(rep, lambda r, x=x: x[r * 8 // n:(r + 1) * 8 // n]))
            return layer

        with rep.scope():
            layer = keras.layers.BatchNormalization(momentum=momentum)
            layer.build((None, 3))
        trained(layer)
        mean, var = np.zeros(3), np.ones(3)
        for x in steps:  # the update averaged over replicas
            m, v = _moments_per_replica(x, n)
            mean, var = momentum * mean + (1 - momentum) * m, momentum * var + (1 - momentum) * v
        for variable, want in ((layer.moving_mean, mean), (layer.moving_variance, var)):
            self.assertSameValuePerReplica(rep, variable.value)
            np.testing.assert_allclose(rep.local_results(variable.value)[0], want, rtol=1e-5, atol=1e-6)
        # One all-reduce per step for all the statistics, whatever their number; a step
        # that reads them (inference) leaves them exactly as they were.
        with rep.scope():
            second = keras.layers.BatchNormalization(momentum=momentum)
            second.build((None, 3))
        with collective_audit.recording_strategy_reductions() as reductions:
            graph = tf.function(lambda a: rep.run(lambda v: second(layer(v, training=True), training=True), a)
                                ).get_concrete_function(support.per_replica(rep, lambda r: steps[0][:8 // n]))
        ops = collective_audit.traced_collectives(graph.graph)
        self.assertEqual(collective_audit.per_replica_elements(ops, reductions, n)["ops"], 1)
        kept = [np.asarray(c) for c in rep.local_results(layer.moving_variance.value)]
        inference = tf.function(lambda a: rep.run(lambda v: layer(v, training=False), a))
        inference(support.per_replica(rep, lambda r: steps[0][r * 8 // n:(r + 1) * 8 // n] * 3.0))
        for want_copy, copy in zip(kept, rep.local_results(layer.moving_variance.value), strict=True):
            np.testing.assert_array_equal(np.asarray(copy), want_copy)
        # The checkpoint holds that one copy: restored on one device, it is the same.
        path = tf.train.Checkpoint(layer=layer).save(os.path.join(self.get_temp_dir(), "bn"))
        single = keras.layers.BatchNormalization()
        single.build((None, 3))
        tf.train.Checkpoint(layer=single).restore(path).assert_existing_objects_matched()
        np.testing.assert_allclose(single.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(single.moving_variance.numpy(), var, rtol=1e-5, atol=1e-6)
        # Negative control: created in the bare strategy scope, each replica keeps its own.
        with rep.strategy.scope():
            bare = keras.layers.BatchNormalization(momentum=momentum)
            bare.build((None, 3))
        trained(bare)
        copies = rep.local_results(bare.moving_mean.value)
        self.assertGreater(np.abs(np.asarray(copies[-1]) - np.asarray(copies[0])).max(), 0.1)

    def test_sync_batch_norm_statistics_are_not_averaged_again(self):
        rep = support.replicator("cpu", 2)
        with rep.scope():
            sync, plain = xf.layers.SyncBatchNorm(), keras.layers.BatchNormalization()
            sync.build((None, 3))
            plain.build((None, 3))
        # Already identical on every replica (explicit synchronization): updated locally and
        # left out of the average; plain batch norm's are averaged by run(), trainable ones
        # are the optimizer's.
            optimizer = xf.wrap_optimizer(keras.optimizers.SGD(0.1, momentum=0.9))
            optimizer.build(plain.trainable_variables)
        averaged = {id(v) for v in rep._statistics.live()}  # pylint: disable=protected-access
        self.assertTrue(optimizer.optimizer.variables)
        for slot in optimizer.optimizer.variables:  # the optimizer's, updated in cross-replica context
            self.assertNotIn(id(slot.value), averaged)
        self.assertNotIn(id(sync.moving_mean.value), averaged)
        self.assertIn(id(plain.moving_mean.value), averaged)
        self.assertIn(id(plain.moving_variance.value), averaged)
        self.assertNotIn(id(plain.gamma.value), averaged)


class WorkerIdentityTest(support.TestCase):
    """Worker identity comes from the cluster resolver; the multi-process runs are in
    tests/test_multi_worker.py. Here: Slurm's resolver on a CPU node, from its environment alone."""

    def test_slurm_resolver_on_a_cpu_node(self):
        env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3",
               "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2,1", "PATH": "/nonexistent"}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("TF_CONFIG", None)
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            resolver = targets._resolver()  # pylint: disable=protected-access
            spec = resolver.cluster_spec().as_dict()
            self.assertNotIn("CUDA_VISIBLE_DEVICES", os.environ)
        self.assertEqual(spec, {"worker": ["node1:8888", "node1:8889", "node2:8888"]})
        self.assertEqual((resolver.task_type, resolver.task_id), ("worker", 2))
        self.assertEqual(resolver.num_accelerators(), {})
