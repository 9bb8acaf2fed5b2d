"""Cross-replica moments: float32 variance within 1e-4 of float64 where E[x^2] - E[x]^2
loses it, with one all-reduce of 2C + 1 floats (a second of C where the shift is far)."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.layers import cross_replica_moments
from expframe.replicator import collective_audit
from tests import support

REPLICAS, PER_REPLICA, CHANNELS = 4, 256, 4


def _parts(means, seed=0):
    """One [PER_REPLICA, CHANNELS] slice per replica, std 1 around its mean."""
    rng = np.random.default_rng(seed)
    return [rng.normal(m, 1.0, size=(PER_REPLICA, CHANNELS)).astype(np.float32) for m in means]


def _moments(parts, shift, group_size=None):
    rep = support.replicator("cpu", len(parts))
    fn = tf.function(lambda v: rep.run(lambda x: cross_replica_moments.moments(
        x, [0], None, tf.constant(shift, tf.float32), group_size), v))
    mean, var = fn(support.per_replica(rep, lambda r: parts[r]))
    return [m.numpy() for m in rep.local_results(mean)], [v.numpy() for v in rep.local_results(var)]


def _relative_error(got, parts):
    want = np.concatenate(parts).astype(np.float64).var(0)
    return float(np.max(np.abs(got - want) / want))


class CrossReplicaMomentsTest(support.TestCase):

    @parameterized.named_parameters(
        ("moving_mean_near", 999.5),      # the steady state: the shifted sums alone
        ("at_the_bound", 996.1),          # (mean - shift)^2 just under FAR x var
        ("first_step_far", 0.0))          # moving mean 0, data mean 1e3: the second pass
    def test_variance_of_mean_1e3_std_1_within_1e4_of_float64(self, shift):
        parts = _parts([1000.0] * REPLICAS)
        means, variances = _moments(parts, [shift] * CHANNELS)
        for mean, var in zip(means, variances, strict=True):
            self.assertLess(_relative_error(var, parts), 1e-4)
            np.testing.assert_allclose(mean, np.concatenate(parts).astype(np.float64).mean(0), rtol=1e-6)
        np.testing.assert_array_equal(variances[0], variances[-1])  # the same on every replica

    def test_negative_control_shifted_sums_alone_lose_the_far_variance(self):
        # Without the second pass (FAR = inf), the first step's sums around 0 are
        # E[x^2] - E[x]^2 in float32: the variance is off by percents.
        parts = _parts([1000.0] * REPLICAS)
        far, cross_replica_moments.FAR = cross_replica_moments.FAR, float("inf")
        try:
            _, variances = _moments(parts, [0.0] * CHANNELS)
        finally:
            cross_replica_moments.FAR = far
        self.assertGreater(_relative_error(variances[0], parts), 1e-2)

    def test_each_group_exact_around_a_far_shift(self):
        # Two groups with means 1e3 and -5e2: each is far from the shared shift 0.
        parts = _parts([1000.0, 1000.0, -500.0, -500.0], seed=1)
        _, variances = _moments(parts, [0.0] * CHANNELS, group_size=2)
        for r, var in enumerate(variances):
            group = parts[r // 2 * 2:r // 2 * 2 + 2]
            self.assertLess(_relative_error(var, group), 1e-4)

    def test_one_all_reduce_of_2c_plus_1_and_a_second_of_c_only_in_the_far_branch(self):
        rep = support.replicator("cpu", 2)
        fn = tf.function(lambda v: rep.run(lambda x: cross_replica_moments.moments(
            x, [0], None, tf.zeros([CHANNELS])), v))
        graph = fn.get_concrete_function(support.per_replica(rep, lambda r: np.ones((3, CHANNELS), np.float32))).graph
        outside = sorted(op.inputs[0].shape.num_elements() for op in graph.get_operations()
                         if op.type == "CollectiveReduce")
        self.assertEqual(outside, [2 * CHANNELS + 1] * 2)  # one per replica, before the branch
        every = sorted(o["elements"] for o in collective_audit.traced_collectives(graph))
        self.assertEqual(every, [CHANNELS] * 2 + [2 * CHANNELS + 1] * 2)  # + the far branch's

    def test_layer_first_step_far_from_its_moving_mean(self):
        """SyncBatchNorm's first step (moving mean 0) on data of mean 1e3: its batch
        variance (the moving variance at momentum 0) within 1e-4 of float64."""
        parts = _parts([1000.0] * REPLICAS, seed=2)
        rep = support.replicator("cpu", REPLICAS)
        with rep.scope():
            layer = xf.layers.SyncBatchNorm(momentum=0.0)
            layer.build((None, CHANNELS))
        tf.function(lambda v: rep.run(lambda x: layer(x, training=True), v))(
            support.per_replica(rep, lambda r: parts[r]))
        self.assertLess(_relative_error(rep.local_results(layer.moving_variance.value)[0], parts), 1e-4)

    def test_where_a_cond_cannot_hold_the_reduction_the_second_pass_runs_every_step(self):
        """MirroredStrategy over GPUs, MultiWorkerMirroredStrategy: their reductions go through
        merge_call, which a cond cannot hold; here forced on CPU replicas."""
        from expframe.replicator import collectives  # pylint: disable=import-outside-toplevel
        parts = _parts([1000.0] * REPLICAS, seed=3)
        real = collectives.reduces_in_control_flow
        collectives.reduces_in_control_flow = lambda *args, **kwargs: False
        try:
            _, variances = _moments(parts, [0.0] * CHANNELS)
            rep = support.replicator("cpu", 2)
            fn = tf.function(lambda v: rep.run(lambda x: cross_replica_moments.moments(
                x, [0], None, tf.zeros([CHANNELS])), v))
            graph = fn.get_concrete_function(support.per_replica(rep, lambda r: parts[r])).graph
        finally:
            collectives.reduces_in_control_flow = real
        self.assertLess(_relative_error(variances[0], parts), 1e-4)
        self.assertNotIn("If", {op.type for op in graph.get_operations()})
        every = sorted(o["elements"] for o in collective_audit.traced_collectives(graph))
        self.assertEqual(every, [CHANNELS] * 2 + [2 * CHANNELS + 1] * 2)  # both passes, unconditionally
