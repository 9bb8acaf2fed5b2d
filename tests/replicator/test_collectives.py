"""Collectives return exactly the expected values on 1, 2 and 4 replicas."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from tests import support


def _value(r):
    # Distinct per replica, with negative entries so max/min are not trivial.
    return np.array([[r + 1.0, -2.0 * r], [0.5 * r, 3.0 - r]], np.float32)


class CollectivesTest(support.TestCase):

    @parameterized.named_parameters(*support.named_replicators())
    def test_reductions(self, target, n):
        rep = support.replicator(target, n)
        expected_values = np.stack([_value(r) for r in range(n)])
        expected = {"sum": expected_values.sum(0), "mean": expected_values.mean(0),
                    "max": expected_values.max(0), "min": expected_values.min(0)}

        @tf.function
        def run(x):
            return rep.run(lambda t: {op: xf.all_reduce(t, op) for op in expected}, x)

        out = run(self.per_replica(rep, _value))
        for op, want in expected.items():
            for got in rep.local_results(out[op]):
                np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=op)

    @parameterized.named_parameters(*support.named_replicators())
    def test_nested_and_mixed_dtypes(self, target, n):
        rep = support.replicator(target, n)

        def step(r):
            r = tf.cast(r, tf.float32)
            nest = {"a": [r, r * 2.0], "b": (tf.fill([3], r), tf.cast(r, tf.int32) + 1), "big": tf.fill([300_000], r)}
            return xf.all_reduce(nest, "sum")

        out = tf.function(lambda x: rep.run(step, x))(self.per_replica(rep, lambda r: r))
        total = sum(range(n))
        local = rep.local_results(out)
        self.assertLen(local, n)
        for got in local:
            self.assertAllEqual(got["a"][0], total)
            self.assertAllEqual(got["a"][1], 2 * total)
            self.assertAllEqual(got["b"][0], [total] * 3)
            self.assertAllEqual(got["b"][1], total + n)
            self.assertEqual(got["b"][1].dtype, tf.int32)
            self.assertAllEqual(got["big"][:5], [total] * 5)

    @parameterized.named_parameters(*support.named_replicators())
    def test_broadcast_from_each_source(self, target, n):
        rep = support.replicator(target, n)
        for source in range(n):
            def step(x, source=source):
                nest = {"x": x, "flag": x[0, 0] > 1.5, "nan_elsewhere": tf.where(
                    tf.equal(xf.replica_id(), source), x, np.nan)}
                return xf.broadcast(nest, source=source)

            out = tf.function(lambda x: rep.run(step, x))(self.per_replica(rep, _value))
            for got in rep.local_results(out):
                np.testing.assert_array_equal(got["x"], _value(source))
                np.testing.assert_array_equal(got["nan_elsewhere"], _value(source))
                self.assertEqual(bool(got["flag"]), source + 1.0 > 1.5)

    @parameterized.named_parameters(*support.named_replicators())
    def test_all_gather_and_ids(self, target, n):
        rep = support.replicator(target, n)

        def step(x):
            return {"gathered": xf.all_gather({"v": x}, axis=0), "id": xf.replica_id(),
                    "n": tf.constant(xf.num_replicas())}

        out = tf.function(lambda x: rep.run(step, x))(self.per_replica(rep, _value))
        want = np.concatenate([_value(r) for r in range(n)], axis=0)
        for r, got in enumerate(rep.local_results(out)):
            np.testing.assert_array_equal(got["gathered"]["v"], want)
            self.assertEqual(int(got["id"]), r)
            self.assertEqual(int(got["n"]), n)

    def test_identity_without_replicator(self):
        x = {"a": tf.constant([1.0, 2.0])}
        self.assertIs(xf.all_reduce(x, "mean"), x)
        self.assertIs(xf.broadcast(x), x)
        self.assertIs(xf.all_gather(x), x)
        self.assertEqual(int(xf.replica_id()), 0)
        self.assertEqual(xf.num_replicas(), 1)

    def test_bad_arguments(self):
        rep = support.replicator("cpu", 2)
        with self.assertRaisesRegex(ValueError, "op='prod'.*sum, mean, max, min"):
            rep.run(lambda: xf.all_reduce(tf.constant(1.0), "prod"))
        with self.assertRaisesRegex(ValueError, r"source=2 must be a replica index in \[0, 2\)"):
            rep.run(lambda: xf.broadcast(tf.constant(1.0), source=2))
        with rep.scope(), self.assertRaisesRegex(RuntimeError, "inside a replicated step"):
            xf.all_reduce(tf.constant(1.0), "sum")

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_reduce_in_cross_replica_context(self, target, n):
        rep = support.replicator(target, n)
        values = self.per_replica(rep, lambda r: np.float32(r * 2 - 1))
        self.assertAllClose(rep.reduce(values, "sum"), sum(r * 2 - 1 for r in range(n)))
        self.assertAllClose(rep.reduce(values, "mean"), np.mean([r * 2 - 1 for r in range(n)]))
        self.assertAllClose(rep.reduce(values, "max"), 2 * n - 3)
        self.assertAllClose(rep.reduce(values, "min"), -1)

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_gradients_flow_to_every_replica(self, target, n):
        # loss_r = sum_s w_s * c_r * gathered/reduced value: d(sum_r loss_r)/d x_r needs
        # the upstream gradients of all replicas, small (own collective ops) and big
        # (the strategy's reduction) alike.
        rep = support.replicator(target, n)
        size_small, size_big = 3, 400_000
        coeff = np.arange(1, n + 1, dtype=np.float32)

        def step(r):
            r = tf.cast(r, tf.float32)
            small, big = tf.fill([size_small], r + 1.0), tf.fill([size_big], r + 1.0)
            with tf.GradientTape() as tape:
                tape.watch([small, big])
                c = r + 1.0
                loss = (c * tf.reduce_sum(xf.all_reduce(small, "sum")) + c * tf.reduce_sum(xf.all_reduce(big, "mean"))
                        + c * tf.reduce_sum(xf.all_gather(small[:1] * small[:1], axis=0) * coeff))
            return tape.gradient(loss, [small, big])

        out = tf.function(lambda x: rep.run(step, x))(self.per_replica(rep, lambda r: r))
        total_c = coeff.sum()
        for r, (g_small, g_big) in enumerate(rep.local_results(out)):
            want = np.full(size_small, total_c, np.float32)
            want[0] += total_c * coeff[r] * 2 * (r + 1.0)  # d/dx of x^2 in row r of the gather
            np.testing.assert_allclose(g_small, want, rtol=1e-6)
            np.testing.assert_allclose(g_big[:3], [total_c / n] * 3, rtol=1e-6)

    def test_small_collectives_use_each_replicas_own_op_on_cpu(self):
        # The strategy's reduction joins the replicas' graphs, which makes tracing the
        # backward pass of many collectives quadratic (see collectives.py).
        rep = support.replicator("cpu", 2)
        fn = tf.function(lambda x: rep.run(
            lambda t: (xf.all_gather(t, 0), xf.all_reduce(t, "sum"),
                       xf.all_reduce(tf.fill([400_000], t[0, 0]), "sum")), x))
        graph = fn.get_concrete_function(self.per_replica(rep, _value)).graph
        ops = [op.type for op in graph.get_operations()]
        self.assertEqual(ops.count("CollectiveReduce"), 4)  # 2 replicas x (gather, small sum)


class GroupedAllReduceTest(support.TestCase):
    """`all_reduce(x, group_size=k)` sums within groups of k consecutive replicas only."""

    @parameterized.named_parameters(("4_in_2", 4, 2), ("8_in_2", 8, 2), ("8_in_4", 8, 4), ("4_in_1", 4, 1))
    def test_sums_and_gradients_stay_in_the_group(self, n, k):
        rep = support.replicator("cpu", n)

        def step(r):
            r = tf.cast(r, tf.float32)
            x = tf.stack([r, 1.0])
            with tf.GradientTape() as tape:
                tape.watch(x)
                summed = xf.all_reduce(x, "sum", group_size=k)
                mean = xf.all_reduce(x * 2.0, "mean", group_size=k)
                loss = (r + 1.0) * tf.reduce_sum(summed) + tf.reduce_sum(mean)
            return summed, mean, tape.gradient(loss, x)

        out = tf.function(lambda v: rep.run(step, v))(self.per_replica(rep, lambda r: r))
        for r, (summed, mean, grad) in enumerate(rep.local_results(out)):
            group = range(r // k * k, r // k * k + k)
            np.testing.assert_allclose(summed, [sum(group), k])
            np.testing.assert_allclose(mean, [2.0 * sum(group) / k, 2.0])
            # d(sum_s loss_s)/dx_r: (s + 1) over the group's replicas s, plus 2/k from each mean.
            np.testing.assert_allclose(grad, [sum(s + 1.0 for s in group) + 2.0] * 2)

    def test_each_group_is_its_own_collective_group_of_k(self):
        # Every op meets k peers, never n: the bytes a replica moves are the group's.
        rep = support.replicator("cpu", 8)
        fn = tf.function(lambda v: rep.run(lambda t: xf.all_reduce(tf.fill([5], t), "sum", group_size=2), v))
        graph = fn.get_concrete_function(self.per_replica(rep, lambda r: np.float32(r))).graph
        reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduce"]
        self.assertLen(reduces, 8)
        self.assertEqual({op.get_attr("group_size") for op in reduces}, {2})
        self.assertLen({op.get_attr("group_key") for op in reduces}, 4)

    def test_group_size_of_all_or_more_is_the_whole_and_bad_sizes_say_so(self):
        rep = support.replicator("cpu", 4)
        out = tf.function(lambda v: rep.run(lambda t: xf.all_reduce(t, "sum", group_size=4), v))(
            self.per_replica(rep, lambda r: np.float32(r)))
        self.assertEqual([float(v) for v in rep.local_results(out)], [6.0] * 4)
        with self.assertRaisesRegex(ValueError, "group_size=3 does not divide the 4 replicas; use a divisor of 4"):
            rep.run(lambda: xf.all_reduce(tf.constant(1.0), "sum", group_size=3))
        with self.assertRaisesRegex(ValueError, "group_size=0 must be a positive integer or None"):
            rep.run(lambda: xf.all_reduce(tf.constant(1.0), "sum", group_size=0))
        with self.assertRaisesRegex(ValueError, "op='max' with group_size: only 'sum' and 'mean'"):
            rep.run(lambda: xf.all_reduce(tf.constant(1.0), "max", group_size=2))

    def test_strategies_without_group_collectives_sum_a_padded_table_per_group(self):
        # MultiWorkerMirroredStrategy has no group collectives: each group writes its row of
        # an (n / k)-row table that all replicas sum. Here forced on CPU replicas.
        from expframe.replicator import collectives  # pylint: disable=import-outside-toplevel
        rep = support.replicator("cpu", 4)

        def step(r):
            x = tf.stack([tf.cast(r, tf.float32), 1.0])
            with tf.GradientTape() as tape:
                tape.watch(x)
                summed = xf.all_reduce(x, "sum", group_size=2)
                loss = tf.cast(r + 1, tf.float32) * tf.reduce_sum(summed)
            return summed, tape.gradient(loss, x)

        own = collectives._own_collective  # noqa: SLF001
        collectives._own_collective = lambda ctx, t, group_size=None: (  # noqa: SLF001
            None if group_size else own(ctx, t))
        try:
            out = tf.function(lambda v: rep.run(step, v))(self.per_replica(rep, lambda r: r))
        finally:
            collectives._own_collective = own  # noqa: SLF001
        for r, (summed, grad) in enumerate(rep.local_results(out)):
            group = range(r // 2 * 2, r // 2 * 2 + 2)
            np.testing.assert_allclose(summed, [sum(group), 2.0])
            np.testing.assert_allclose(grad, [sum(s + 1.0 for s in group)] * 2)
