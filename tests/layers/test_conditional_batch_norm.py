"""ConditionalBatchNorm: per-class scale and offset, global-batch moments on N replicas
(equal to one device on the whole batch; per-replica batch norm is not)."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.layers import ConditionalBatchNorm
from tests import support

CLASSES = 5


def _data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 3, 3, 4)) * 2.0 + 1.5).astype(np.float32)
    return x, rng.integers(0, CLASSES, size=(n,)).astype(np.int32)


def _layer(rep):
    with rep.scope():
        layer = ConditionalBatchNorm(CLASSES, momentum=0.5)
        layer.build([(None, 3, 3, 4), (None,)])
        rng = np.random.default_rng(7)
        layer.gamma.assign(rng.uniform(0.5, 2.0, size=(CLASSES, 4)).astype(np.float32))
        layer.beta.assign(rng.normal(size=(CLASSES, 4)).astype(np.float32))
    return layer


def _train(rep, layer, x, y):
    """One training call on the global batch split over replicas: outputs, dL/dx, dL/dgamma."""
    b = len(x) // rep.num_replicas
    weights = np.random.default_rng(9).normal(size=x.shape).astype(np.float32)

    def step(xs, ys, ws):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            out = layer([xs, ys], training=True)
            loss = tf.reduce_sum(out * ws)
        dx, dgamma = tape.gradient(loss, [xs, layer.gamma.value])
        return {"y": out, "dx": dx, "dgamma": xf.all_reduce(tf.convert_to_tensor(dgamma), "sum")}

    got = tf.function(lambda *a: rep.run(step, *a))(
        *(support.per_replica(rep, lambda r, t=t: t[r * b:(r + 1) * b]) for t in (x, y, weights)))
    cat = lambda v: np.concatenate([np.asarray(t) for t in rep.local_results(v)])  # noqa: E731
    return {"y": cat(got["y"]), "dx": cat(got["dx"]), "dgamma": np.asarray(rep.local_results(got["dgamma"])[0])}


class ConditionalBatchNormTest(support.TestCase):

    def test_scale_and_offset_are_per_class(self):
        x, y = _data()
        layer = _layer(support.replicator("cpu", 1))
        out = layer([x, y], training=True).numpy()
        mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
        normalised = (x - mean) / np.sqrt(var + layer.epsilon)
        want = normalised * layer.gamma.numpy()[y][:, None, None, :] + layer.beta.numpy()[y][:, None, None, :]
        np.testing.assert_allclose(out, want, atol=1e-5)
        # Eval uses the moving statistics (momentum 0.5 from mean 0, variance 1).
        moving_mean = 0.5 * mean
        np.testing.assert_allclose(layer.norm.moving_mean.numpy(), moving_mean, atol=1e-5)

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_n_replicas_equal_one_device_on_the_global_batch(self, target, n):
        x, y = _data()
        one_rep = support.replicator("cpu", 1)
        one = _layer(one_rep)
        want = _train(one_rep, one, x, y)
        rep = support.replicator(target, n)
        layer = _layer(rep)
        got = _train(rep, layer, x, y)
        for key in ("y", "dx", "dgamma"):
            np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=1e-5, err_msg=key)
        for name in ("moving_mean", "moving_variance"):
            self.assertSameValuePerReplica(rep, getattr(layer.norm, name).value)
            np.testing.assert_allclose(rep.local_results(getattr(layer.norm, name).value)[0],
                                       getattr(one.norm, name).numpy(), atol=1e-5, err_msg=name)

    def test_per_replica_statistics_would_differ(self):
        # Negative control: normalising each half with its own moments is not the global result.
        x, y = _data()
        one_rep = support.replicator("cpu", 1)
        want = _train(one_rep, _layer(one_rep), x, y)["y"]
        halves = [_layer(one_rep)([x[i:i + 8], y[i:i + 8]], training=True).numpy() for i in (0, 8)]
        self.assertGreater(np.abs(np.concatenate(halves) - want).max(), 1e-2)

    def test_bad_num_classes_is_a_config_error(self):
        with self.assertRaisesRegex(xf.ConfigError, "num_classes=0"):
            ConditionalBatchNorm(0)

    def test_starts_as_plain_batch_norm(self):
        layer = ConditionalBatchNorm(3)
        x, _ = _data()
        out = layer([x, np.zeros(len(x), np.int32)], training=True).numpy()
        ref = keras.layers.BatchNormalization(momentum=0.9, epsilon=2e-5, center=False, scale=False)
        np.testing.assert_allclose(out, ref(x, training=True).numpy(), atol=1e-5)
