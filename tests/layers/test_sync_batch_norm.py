"""SyncBatchNorm on N replicas equals BatchNormalization on the whole batch on one device."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.layers import sync_batch_norm
from expframe.replicator import keras_hooks
from tests import support

GLOBAL_BATCH = 8


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(2.0, 3.0, size=(GLOBAL_BATCH, 5, 5, 3)).astype(np.float32)
    w = rng.normal(size=x.shape).astype(np.float32)  # weights of the loss sum(w * y)
    return x, w


def _init_layer(layer, seed=1):
    rng = np.random.default_rng(seed)
    layer.gamma.assign(rng.uniform(0.5, 1.5, size=3).astype(np.float32))
    layer.beta.assign(rng.normal(size=3).astype(np.float32))


def _reference(x, w):
    """Plain Keras BN, one device, whole batch: outputs, grads, moving stats."""
    layer = keras.layers.BatchNormalization(momentum=0.9)
    layer.build(x.shape)
    _init_layer(layer)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt, training=True)
        loss = tf.reduce_sum(y * w)
    dx, dgamma, dbeta = tape.gradient(loss, [xt, layer.gamma, layer.beta])
    return dict(y=y.numpy(), dx=dx.numpy(), dgamma=dgamma.numpy(), dbeta=dbeta.numpy(),
                mean=layer.moving_mean.numpy(), var=layer.moving_variance.numpy())


def _replicated(rep, x, w, layer_cls=xf.layers.SyncBatchNorm, **kwargs):
    n = rep.num_replicas
    b = GLOBAL_BATCH // n
    with rep.scope():
        layer = layer_cls(momentum=0.9, **kwargs)
        layer.build(x.shape)
        _init_layer(layer)

    def step(xs, ws):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = layer(xs, training=True)
            loss = tf.reduce_sum(y * ws)
        dx, dgamma, dbeta = tape.gradient(loss, [xs, layer.gamma, layer.beta])
        return dict(y=y, dx=dx, dgamma=dgamma, dbeta=dbeta)

    def split(a):
        return lambda r: a[r * b:(r + 1) * b]

    out = tf.function(lambda a, c: rep.run(step, a, c))(
        support.per_replica(rep, split(x)), support.per_replica(rep, split(w)))
    local = rep.local_results(out)
    result = dict(
        y=np.concatenate([o["y"] for o in local]), dx=np.concatenate([o["dx"] for o in local]),
        dgamma=np.sum([o["dgamma"] for o in local], 0), dbeta=np.sum([o["dbeta"] for o in local], 0),
        mean=layer.moving_mean.value, var=layer.moving_variance.value)
    return result, layer


class SyncBatchNormTest(support.TestCase):

    @parameterized.named_parameters(*support.named_replicators(), ("cpu_8", "cpu", 8))
    def test_equals_full_batch_bn(self, target, n):
        x, w = _data()
        want = _reference(x, w)
        rep = support.replicator(target, n)
        got, layer = _replicated(rep, x, w)
        for key in ("y", "dx", "dgamma", "dbeta"):
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=1e-5, err_msg=key)
        for key in ("mean", "var"):
            self.assertSameValuePerReplica(rep, got[key])
            np.testing.assert_allclose(rep.local_results(got[key])[0], want[key], atol=1e-5, err_msg=key)

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_negative_control_plain_bn_differs(self, target, n):
        x, w = _data()
        want = _reference(x, w)
        got, _ = _replicated(support.replicator(target, n), x, w, keras.layers.BatchNormalization)
        self.assertGreater(np.abs(got["y"] - want["y"]).max(), 1e-2)

    def test_group_size(self):
        """4 replicas in groups of 2 normalise each half alone; moving stats average the halves'."""
        x, w = _data()
        rep = support.replicator("cpu", 4)
        got, layer = _replicated(rep, x, w, group_size=2)
        halves = [_reference(x[:4], w[:4]), _reference(x[4:], w[4:])]
        np.testing.assert_allclose(got["y"], np.concatenate([h["y"] for h in halves]), atol=1e-5)
        np.testing.assert_allclose(got["dx"], np.concatenate([h["dx"] for h in halves]), atol=1e-5)
        self.assertSameValuePerReplica(rep, got["mean"])
        np.testing.assert_allclose(rep.local_results(got["mean"])[0], _reference(x, w)["mean"], atol=1e-5)
        np.testing.assert_allclose(rep.local_results(got["var"])[0], np.mean([h["var"] for h in halves], 0),
                                   atol=1e-5)

    @parameterized.named_parameters(("8_in_4", 8, 4), ("8_in_2", 8, 2), ("4_in_1", 4, 1))
    def test_groups_equal_per_group_bn(self, n, k):
        """Each group of k replicas normalises its own slice of the batch, forward and backward;
        the moving statistics are the groups', averaged over the replicas: the same on every
        replica, the whole batch's mean, and the mean of the groups' variances."""
        x, w = _data(2)
        rep = support.replicator("cpu", n)
        got, _ = _replicated(rep, x, w, group_size=k)
        size = GLOBAL_BATCH // n * k
        groups = [_reference(x[i:i + size], w[i:i + size]) for i in range(0, GLOBAL_BATCH, size)]
        for key in ("y", "dx"):
            np.testing.assert_allclose(got[key], np.concatenate([g[key] for g in groups]), atol=1e-5, err_msg=key)
        for key in ("dgamma", "dbeta"):
            np.testing.assert_allclose(got[key], np.sum([g[key] for g in groups], 0), atol=1e-5, err_msg=key)
        whole = _reference(x, w)
        for key in ("mean", "var"):
            self.assertSameValuePerReplica(rep, got[key])
            np.testing.assert_allclose(rep.local_results(got[key])[0], np.mean([g[key] for g in groups], 0),
                                       atol=1e-5, err_msg=key)
        np.testing.assert_allclose(rep.local_results(got["mean"])[0], whole["mean"], atol=1e-5)
        # The groups' variances miss the variance between their means: below the whole batch's.
        self.assertTrue(np.all(rep.local_results(got["var"])[0] < whole["var"]))
        # Negative control: the groups' normalisation is not the whole batch's.
        self.assertGreater(np.abs(got["y"] - whole["y"]).max(), 1e-2)

    @parameterized.named_parameters(("mixed_bfloat16", "mixed_bfloat16", None),
                                    ("mixed_float16_groups", "mixed_float16", 2))
    def test_mixed_precision_moments_in_float32(self, policy, group_size):
        """16-bit inputs: outputs in the compute dtype, moments (so the moving statistics) in float32."""
        x, _ = _data(4)
        x = x * 0.1 + 100.0  # a mean where 16-bit moments would be coarse
        rep = support.replicator("cpu", 4)
        with rep.scope():
            layer = xf.layers.SyncBatchNorm(momentum=0.0, dtype=policy, group_size=group_size)
            layer.build(x.shape)
        ref = keras.layers.BatchNormalization(momentum=0.0, dtype=policy)
        ref.build(x.shape)
        compute = tf.bfloat16 if "bfloat16" in policy else tf.float16
        inputs = tf.cast(x, compute)
        y = tf.function(lambda v: rep.run(lambda t: layer(t, training=True), v))(
            support.per_replica(rep, lambda r: inputs[2 * r:2 * r + 2]))
        self.assertEqual(rep.local_results(y)[0].dtype, compute)
        want = ref(inputs, training=True)
        got = np.concatenate([np.asarray(v, np.float32) for v in rep.local_results(y)])
        if group_size is None:
            np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=2e-2)
        self.assertEqual(layer.moving_variance.dtype, "float32")
        np.testing.assert_allclose(rep.local_results(layer.moving_mean.value)[0], ref.moving_mean.numpy(), rtol=1e-6)
        if group_size is None:
            np.testing.assert_allclose(rep.local_results(layer.moving_variance.value)[0],
                                       ref.moving_variance.numpy(), rtol=1e-4)

    def test_group_size_must_divide_replicas(self):
        x, w = _data()
        with self.assertRaisesRegex(xf.ConfigError, "group_size=3 does not divide the 4 replicas"):
            _replicated(support.replicator("cpu", 4), x, w, group_size=3)
        with self.assertRaisesRegex(xf.ConfigError, "group_size=0"):
            xf.layers.SyncBatchNorm(group_size=0)

    def test_inference_uses_moving_statistics(self):
        x, _ = _data()
        rep = support.replicator("cpu", 2)
        with rep.scope():
            layer = xf.layers.SyncBatchNorm()
            layer.build(x.shape)
            _init_layer(layer)
        ref = keras.layers.BatchNormalization()
        ref.build(x.shape)
        _init_layer(ref)
        y = rep.run(lambda a: layer(a, training=False), tf.constant(x))
        for got in rep.local_results(y):
            np.testing.assert_allclose(got, ref(x, training=False), atol=1e-6)

    def test_same_weights_and_config_as_keras_bn(self):
        sync, plain = xf.layers.SyncBatchNorm(momentum=0.8, epsilon=1e-3), keras.layers.BatchNormalization()
        sync.build((None, 3)), plain.build((None, 3))
        self.assertEqual([v.path.split("/")[-1] for v in sync.weights], [v.path.split("/")[-1] for v in plain.weights])
        clone = xf.layers.SyncBatchNorm.from_config(xf.layers.SyncBatchNorm(group_size=2, momentum=0.8).get_config())
        self.assertEqual((clone.group_size, clone.momentum), (2, 0.8))
        model = keras.Sequential([keras.Input((3,)), xf.layers.SyncBatchNorm(group_size=2)])
        restored = keras.models.model_from_json(model.to_json())
        self.assertIsInstance(restored.layers[0], xf.layers.SyncBatchNorm)

    def test_masked_inputs(self):
        rng = np.random.default_rng(3)
        x = rng.normal(size=(4, 6, 3)).astype(np.float32)
        mask = rng.uniform(size=(4, 6)) > 0.3
        ref = keras.layers.BatchNormalization()
        want = ref(x, training=True, mask=mask)
        rep = support.replicator("cpu", 2)
        with rep.scope():
            layer = xf.layers.SyncBatchNorm()
        y = rep.run(lambda a, m: layer(a, training=True, mask=m),
                    support.per_replica(rep, lambda r: x[2 * r:2 * r + 2]),
                    support.per_replica(rep, lambda r: mask[2 * r:2 * r + 2]))
        got = np.concatenate(rep.local_results(y))
        np.testing.assert_allclose(got[np.broadcast_to(mask[..., None], got.shape)],
                                   np.asarray(want)[np.broadcast_to(mask[..., None], got.shape)], atol=1e-4)

    def test_refuses_cross_replica_training_call(self):
        rep = support.replicator("cpu", 2)
        with rep.scope():
            layer = xf.layers.SyncBatchNorm()
            with self.assertRaisesRegex(xf.ConfigError, "must run inside Replicator.run"):
                layer(tf.ones([4, 3]), training=True)


class KerasHooksTest(support.TestCase):

    def test_missing_keras_hook_fails_loudly(self):
        sync_batch_norm.check_keras_hooks()  # the installed Keras has them
        bn = keras.layers.BatchNormalization
        moments = vars(bn)["_moments"]
        delattr(bn, "_moments")
        try:
            with self.assertRaisesRegex(keras_hooks.KerasHookError,
                                        r"SyncBatchNorm overrides a private Keras hook, but .*BatchNormalization "
                                        r"has no method _moments in Keras 3\.\d+.*per-replica moments.*"
                                        r"supports Keras >=3.15,<3.16"):
                sync_batch_norm.check_keras_hooks()
        finally:
            bn._moments = moments
        build = vars(bn)["build"]
        bn.build = lambda self, input_shape: None  # a release that names the axes differently
        try:
            with self.assertRaisesRegex(keras_hooks.KerasHookError, r"build no longer sets _reduction_axes"):
                sync_batch_norm.check_keras_hooks()
        finally:
            bn.build = build
        sync_batch_norm.check_keras_hooks()
