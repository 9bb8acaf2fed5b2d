"""Spectral norm: sigma matches NumPy's SVD; u is the same on every replica, is not
advanced at eval, and survives a checkpoint round trip; gradients flow through sigma."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.layers import SNConv2D, SNDense, SNEmbedding
from tests import support

# (layer, input) makers: dense, conv and embedding kernels.
LAYERS = {
    "dense": (lambda: SNDense(24), lambda rng, n: rng.normal(size=(n, 40)).astype(np.float32)),
    "conv": (lambda: SNConv2D(16, 3), lambda rng, n: rng.normal(size=(n, 6, 6, 8)).astype(np.float32)),
    "embedding": (lambda: SNEmbedding(10, 12), lambda rng, n: rng.integers(0, 10, size=(n,)).astype(np.int32)),
}


def _top_singular_value(kernel):
    kernel = np.asarray(kernel, np.float64)
    return np.linalg.svd(kernel.reshape(-1, kernel.shape[-1]), compute_uv=False)[0]


class SpectralNormTest(support.TestCase):

    @parameterized.named_parameters(*[(name, name) for name in LAYERS])
    def test_normalised_kernel_has_unit_largest_singular_value(self, name):
        make, inputs = LAYERS[name]
        keras.utils.set_random_seed(0)
        layer = make()
        x = inputs(np.random.default_rng(0), 4)
        layer(x, training=True)
        call = tf.function(lambda: layer(x, training=True))
        for _ in range(60):  # one power iteration per training call, as in the paper
            call()
        kernel = layer.kernel.numpy()
        self.assertAllClose(float(layer.sigma()), _top_singular_value(kernel), rtol=1e-3)
        self.assertAllClose(_top_singular_value(layer.normalized_kernel().numpy()), 1.0, atol=1e-3)
        # The kernel itself was never overwritten (Keras' wrapper writes W / sigma into it).
        self.assertGreater(abs(_top_singular_value(kernel) - 1.0), 0.1)

    def test_eval_does_not_advance_u_and_training_does(self):
        layer = SNDense(8)
        x = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32)
        layer(x, training=False)
        u = layer.sn_u.numpy().copy()
        out = layer(x, training=False).numpy()
        np.testing.assert_array_equal(layer.sn_u.numpy(), u)
        want = x @ layer.normalized_kernel().numpy() + layer.bias.numpy()
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        layer(x, training=True)
        self.assertGreater(np.abs(layer.sn_u.numpy() - u).max(), 1e-4)

    def test_gradient_flows_through_sigma(self):
        layer = SNDense(6)
        x = tf.constant(np.random.default_rng(2).normal(size=(4, 5)).astype(np.float32))
        layer(x)
        u = tf.constant(layer.sn_u.numpy())
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(x, training=False)))
        got = tape.gradient(loss, layer.kernel.value)
        with tf.GradientTape() as tape:  # W / sigma(W) with u, v constants and sigma differentiated
            w = tf.convert_to_tensor(layer.kernel.value)
            tape.watch(w)
            v = tf.stop_gradient(tf.math.l2_normalize(tf.matmul(u, w, transpose_b=True)))
            u2 = tf.stop_gradient(tf.math.l2_normalize(tf.matmul(v, w)))
            sigma = tf.reshape(tf.matmul(tf.matmul(v, w), u2, transpose_b=True), [])
            loss = tf.reduce_sum(tf.square(tf.matmul(x, w / sigma) + layer.bias))
        want = tape.gradient(loss, w)
        self.assertAllClose(got, want, rtol=1e-5, atol=1e-6)
        with tf.GradientTape() as tape:  # a constant sigma would give a different gradient
            tape.watch(w)
            loss = tf.reduce_sum(tf.square(tf.matmul(x, w / tf.stop_gradient(sigma)) + layer.bias))
        self.assertGreater(np.abs(tape.gradient(loss, w) - got).max(), 1e-3)

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_u_is_the_same_on_every_replica_and_equals_one_replica(self, target, n):
        rng = np.random.default_rng(3)
        x = rng.normal(size=(8, 6, 6, 4)).astype(np.float32)

        def run(rep):
            keras.utils.set_random_seed(0)
            with rep.scope():
                layer = SNConv2D(8, 3)
                layer.build((None, 6, 6, 4))
            b = len(x) // rep.num_replicas
            data = support.per_replica(rep, lambda r: x[r * b:(r + 1) * b])
            step = tf.function(lambda d: rep.run(lambda t: tf.reduce_sum(layer(t, training=True)), d))
            for _ in range(3):
                step(data)
            return layer

        one = run(support.replicator("cpu", 1))
        rep = support.replicator(target, n)
        many = run(rep)
        self.assertSameValuePerReplica(rep, many.sn_u.value)
        self.assertAllClose(rep.local_results(many.sn_u.value)[0], one.sn_u.numpy(), rtol=1e-6, atol=1e-7)

    def test_u_survives_a_checkpoint_round_trip_into_another_replica_count(self):
        keras.utils.set_random_seed(0)
        layer = SNEmbedding(10, 6)
        ids = np.arange(10, dtype=np.int32)
        for _ in range(5):
            layer(ids, training=True)
        path = tf.train.Checkpoint(layer=layer).write(self.get_temp_dir() + "/sn")
        rep = support.replicator("cpu", 2)
        keras.utils.set_random_seed(1)
        with rep.scope():
            restored = SNEmbedding(10, 6)
            restored.build()
        self.assertGreater(np.abs(rep.local_results(restored.sn_u.value)[0] - layer.sn_u.numpy()).max(), 1e-3)
        tf.train.Checkpoint(layer=restored).read(path).assert_consumed()
        for value in rep.local_results(restored.sn_u.value):
            np.testing.assert_array_equal(value, layer.sn_u.numpy())
        np.testing.assert_array_equal(rep.local_results(restored.kernel.value)[0], layer.kernel.numpy())

    def test_plain_layer_without_spectral_norm(self):
        layer = SNConv2D(4, 3, use_sn=False)
        x = np.ones((1, 5, 5, 2), np.float32)
        layer(x, training=True)
        self.assertFalse(hasattr(layer, "sn_u"))
        self.assertAllClose(layer.normalized_kernel(), layer.kernel.numpy())

    def test_bad_power_iterations_is_a_config_error(self):
        with self.assertRaisesRegex(xf.ConfigError, "power_iterations=0"):
            SNDense(3, power_iterations=0)
