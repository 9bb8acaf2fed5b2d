"""Tensor-parallel layers equal the unsharded computation on 1x1, 2x2 and 1x4 meshes."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from expframe.errors import ConfigError
from expframe.layers import tensor_parallel as tp
from expframe.replicator import mesh
from tests.support import TestCase

MESHES = (("1x1", 1, 1), ("2x2", 2, 2), ("1x4", 1, 4))
_X = np.random.RandomState(0).randn(4, 5, 16).astype(np.float32)


def _gelu(x):
    return np.asarray(tf.nn.gelu(x))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_mlp(x, up_k, up_b, down_k, down_b):
    """The unsharded Megatron MLP in numpy."""
    return _gelu(x @ up_k + up_b) @ down_k + down_b


def reference_attention(x, q, k, v, qkv_b, out, out_b):
    """Unsharded multi-head self-attention in numpy (kernels [d, heads, head_dim])."""
    qh = np.einsum("btd,dhk->bthk", x, q) + qkv_b[0]
    kh = np.einsum("btd,dhk->bthk", x, k) + qkv_b[1]
    vh = np.einsum("btd,dhk->bthk", x, v) + qkv_b[2]
    logits = np.einsum("bthk,bshk->bhts", qh, kh) / np.sqrt(q.shape[-1])
    mixed = np.einsum("bhts,bshk->bthk", _softmax(logits), vh)
    return np.einsum("bthk,hkd->btd", mixed, out) + out_b


def _host(value):
    if isinstance(value, list):
        return [_host(v) for v in value]
    return mesh.to_host(value) if isinstance(value, tf.Variable) else value


class TensorParallelTest(TestCase):

    @parameterized.named_parameters(*MESHES)
    def test_mlp_and_attention_equal_unsharded(self, batch, model):
        m = mesh.make_mesh({"batch": batch, "model": model})
        with mesh.use_mesh(m):
            mlp = tp.ParallelMLP(16, 32, seed=1)
            attention = tp.HeadParallelAttention(16, 4, seed=2)
            x = mesh.shard_batch(_X)

            @tf.function
            def forward(x):
                with tf.GradientTape() as tape:
                    a = attention(x)
                    y = mlp(a)
                    loss = tf.reduce_mean(y ** 2)
                return a, y, tape.gradient(loss, mlp.up.kernel)

            a, y, grad = forward(x)
        # The column kernel and its gradient are split by columns over `model`.
        self.assertEqual(mesh.axes_of(mlp.up.kernel), [None, "model"])
        self.assertEqual(mesh.axes_of(mlp.down.kernel), ["model", None])
        self.assertEqual(mesh.shard_shapes(mlp.up.kernel)[0], (16, 32 // model))
        self.assertEqual(mesh.shard_shapes(attention.query)[0], (16, 4 // model, 4))
        host = {name: _host(v) for name, v in
                [("q", attention.query), ("k", attention.key), ("v", attention.value),
                 ("qkv_b", [attention.query_bias, 0.0, attention.value_bias]),
                 ("out", attention.out), ("out_b", attention.out_bias)]}
        want_a = reference_attention(_X, **host).astype(np.float32)
        np.testing.assert_allclose(mesh.to_host(a), want_a, atol=1e-5)
        weights = [mesh.to_host(v) for v in (mlp.up.kernel, mlp.up.bias, mlp.down.kernel, mlp.down.bias)]
        want_y = reference_mlp(want_a, *weights)
        np.testing.assert_allclose(mesh.to_host(y), want_y, atol=1e-5)
        # The same seed gives the same weights on every mesh shape.
        ref = tp.truncated_normal(1, (2.0 / 48) ** 0.5)([16, 32])
        np.testing.assert_allclose(weights[0], ref, atol=0)
        # Gradient against the unsharded one (plain TF on the host).
        up_k = tf.Variable(weights[0])
        with tf.GradientTape() as tape:
            h = tf.nn.gelu(tf.constant(want_a) @ up_k + weights[1])
            loss = tf.reduce_mean((h @ weights[2] + weights[3]) ** 2)
        np.testing.assert_allclose(mesh.to_host(grad), tape.gradient(loss, up_k), atol=1e-6)

    @parameterized.named_parameters(*MESHES[:2])
    def test_conv_stem_equals_unsharded(self, batch, model):
        images = np.random.RandomState(2).randn(4, 8, 8, 3).astype(np.float32)
        with mesh.use_mesh(mesh.make_mesh({"batch": batch, "model": model})):
            stem = tp.ConvStem(3, (8, 16), seed=4)

            @tf.function
            def forward(x):
                with tf.GradientTape() as tape:
                    y = stem(x)
                    loss = tf.reduce_mean(y ** 2)
                return y, tape.gradient(loss, stem.kernels[0])

            y, grad = forward(mesh.shard_batch(images))
        self.assertEqual(mesh.axes_of(stem.kernels[1]), [None] * 4)  # replicated
        kernels = [tf.Variable(mesh.to_host(k)) for k in stem.kernels]
        with tf.GradientTape() as tape:
            x = tf.constant(images)
            for k in kernels:  # norm scale 1 and offset 0 at initialization
                x = tf.nn.conv2d(x, k, strides=2, padding="SAME")
                mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
                x = tf.nn.relu((x - mean) * tf.math.rsqrt(variance + 1e-6))
            loss = tf.reduce_mean(x ** 2)
        self.assertEqual(mesh.to_host(y).shape, (4, 2, 2, 16))
        np.testing.assert_allclose(mesh.to_host(y), x, atol=1e-5)
        np.testing.assert_allclose(mesh.to_host(grad), tape.gradient(loss, kernels[0]), atol=1e-6)
        self.assertGreater(np.abs(mesh.to_host(grad)).max(), 1e-4)

    def test_missing_reduction_is_noticed(self):
        """Negative control: the output of one device's row shard, without the all-reduce
        over `model`, misses the other shards' partial sums by far more than the tolerance."""
        m = mesh.make_mesh({"batch": 1, "model": 4})
        with mesh.use_mesh(m):
            row = tp.RowParallelDense(32, 16, seed=3)
            h = np.random.RandomState(1).randn(2, 3, 32).astype(np.float32)
            y = mesh.to_host(row(mesh.relayout(mesh.shard_batch(h), ("batch", None, "model"))))
        kernel = mesh.to_host(row.kernel)
        np.testing.assert_allclose(y, h @ kernel, atol=1e-5)
        local_only = h[..., :8] @ kernel[:8]  # device 0's partial sum alone
        self.assertGreater(np.abs(local_only - h @ kernel).max(), 0.1)
        self.assertEqual(len(mesh.shard_shapes(row.kernel)), 4)

    def test_model_dimension_not_divisible_is_config_error(self):
        with mesh.use_mesh(mesh.make_mesh({"batch": 1, "model": 4})):
            with self.assertRaisesRegex(ConfigError, r"ViT.mlp_dim=6 is not divisible by the mesh's 'model' "
                                                     r"axis of size 4 \(Replicator.mesh_shape\)"):
                tp.ParallelMLP(16, 6, seed=0, binding="ViT.mlp_dim")
            with self.assertRaisesRegex(ConfigError, "ViT.num_heads=2 is not divisible"):
                tp.HeadParallelAttention(16, 2, seed=0, binding="ViT.num_heads")
