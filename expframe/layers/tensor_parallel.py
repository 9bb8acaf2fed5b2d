"""Tensor-parallel layers on a mesh's `model` axis (Megatron-LM, arXiv 1909.08053).

Keras 3 layers are not DTensor-aware on TensorFlow (their kernels are plain
tensors), so these are `tf.Module`s holding DTensor variables whose layouts come
from `expframe.replicator.mesh`. On a 1x1 mesh they compute exactly what the
unsharded layer computes; on a mesh with `model` = m:

- `ColumnParallelDense` splits its kernel by output columns: each device computes
  units/m of the outputs from the whole input. No communication.
- `RowParallelDense` splits its kernel by input rows: each device contracts its
  slice of the input with its slice of the kernel, giving a partial sum; the one
  all-reduce over `model` (inserted by the SPMD pass when the output is laid out
  whole) adds the m partial sums. A column/row pair (`ParallelMLP`) therefore
  needs one reduction in the forward pass, none in between.
- `HeadParallelAttention` gives each device heads/m of the heads (their query, key
  and value columns and their rows of the output projection): attention itself is
  local to a head, and the output projection is the pair's row half, one reduction.
- `LayerNorm`, `PatchEmbedding` and `ConvStem` hold replicated variables.

Activations keep the batch split over `batch` throughout.
"""

from typing import Callable, Optional

import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator import mesh

BATCH, MODEL = mesh.BATCH, mesh.MODEL


def truncated_normal(seed: int, stddev: float) -> Callable:
    """An initializer: a stateless truncated normal from a seed (the same on every mesh)."""
    def init(shape):
        return tf.random.stateless_truncated_normal(shape, seed=[seed, 0], stddev=stddev)
    return init


def _glorot(seed: int, fan_in: int, fan_out: int) -> Callable:
    return truncated_normal(seed, (2.0 / (fan_in + fan_out)) ** 0.5)


class ColumnParallelDense(tf.Module):
    """`y = x W + b` with W's output columns (and b) split over `model`.

    Args:
      in_features: the input's last dimension (whole on every device).
      units: outputs; must divide by the `model` axis.
      seed: initializer seed.
      binding: the gin binding that sets `units`, named in errors.
    """

    def __init__(self, in_features: int, units: int, seed: int, binding: str = "units",
                 name: Optional[str] = None):
        super().__init__(name=name)
        mesh.check_divisible(units, binding)
        self.kernel = mesh.variable(lambda: _glorot(seed, in_features, units)([in_features, units]),
                                    (None, MODEL), name="kernel")
        self.bias = mesh.variable(lambda: tf.zeros([units]), (MODEL,), name="bias")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        """x: [batch, tokens, in_features], whole over `model` -> [batch, tokens, units/model]."""
        return tf.einsum("btd,du->btu", x, self.kernel) + self.bias


class RowParallelDense(tf.Module):
    """`y = x W + b` with W's input rows split over `model`; b is replicated.

    The input comes split over `model` on its last dimension (a ColumnParallelDense's
    output); the output is whole on every device after one all-reduce over `model`.
    """

    def __init__(self, in_features: int, units: int, seed: int, binding: str = "in_features",
                 name: Optional[str] = None):
        super().__init__(name=name)
        self.mesh = mesh.current_mesh()
        mesh.check_divisible(in_features, binding)
        self.kernel = mesh.variable(lambda: _glorot(seed, in_features, units)([in_features, units]),
                                    (MODEL, None), name="kernel")
        self.bias = mesh.variable(lambda: tf.zeros([units]), (None,), name="bias")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        """x: [batch, tokens, in_features/model] -> [batch, tokens, units], whole over `model`."""
        partial = tf.einsum("btu,ud->btd", x, self.kernel)
        # The one reduction over `model`: laying the partial sums out whole adds them.
        return mesh.relayout(partial, (BATCH, None, None), self.mesh) + self.bias


class ParallelMLP(tf.Module):
    """The Megatron MLP: column-parallel dense, GELU, row-parallel dense (one reduction)."""

    def __init__(self, width: int, hidden: int, seed: int, binding: str = "mlp_dim",
                 name: Optional[str] = None):
        super().__init__(name=name)
        self.up = ColumnParallelDense(width, hidden, seed, binding=binding, name="up")
        self.down = RowParallelDense(hidden, width, seed + 1, binding=binding, name="down")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        return self.down(tf.nn.gelu(self.up(x)))


class HeadParallelAttention(tf.Module):
    """Multi-head self-attention with the heads split over `model`.

    Query, key and value kernels are [width, heads, head_dim] split on heads; the
    output kernel is [heads, head_dim, width] split on heads, so the output
    projection contracts over the split heads: one all-reduce over `model`.

    Args:
      width: the model width (input and output features).
      num_heads: heads; must divide by the `model` axis.
      seed: initializer seed.
      binding: the gin binding that sets `num_heads`, named in errors.
    """

    def __init__(self, width: int, num_heads: int, seed: int, binding: str = "num_heads",
                 name: Optional[str] = None):
        super().__init__(name=name)
        self.mesh = mesh.current_mesh()
        mesh.check_divisible(num_heads, binding)
        if width % num_heads:
            raise ConfigError(f"{binding}={num_heads} does not divide the width {width}; "
                              "use a number of heads that divides the width.")
        self.head_dim = width // num_heads
        shape = [width, num_heads, self.head_dim]
        self.query, self.key, self.value = (
            mesh.variable(lambda i=i: _glorot(seed + i, width, width)(shape), (None, MODEL, None), name=n)
            for i, n in enumerate(("query", "key", "value")))
        # Separate biases rather than one stacked [3, heads, head_dim] variable: the gradient
        # of a slice of a DTensor variable came out wrong after relayout on meshes with
        # batch > 1 (TF 2.21). No key bias: it adds q.b to every logit of a query, which
        # softmax cancels, so its gradient is rounding noise that Adam would amplify.
        self.query_bias, self.value_bias = (
            mesh.variable(lambda: tf.zeros([num_heads, self.head_dim]), (MODEL, None), name=n)
            for n in ("query_bias", "value_bias"))
        self.out = mesh.variable(lambda: _glorot(seed + 3, width, width)([num_heads, self.head_dim, width]),
                                 (MODEL, None, None), name="out")
        self.out_bias = mesh.variable(lambda: tf.zeros([width]), (None,), name="out_bias")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        """x: [batch, tokens, width], whole over `model` -> the same shape and layout."""
        q = tf.einsum("btd,dhk->bthk", x, self.query) + self.query_bias
        k = tf.einsum("btd,dhk->bthk", x, self.key)
        v = tf.einsum("btd,dhk->bthk", x, self.value) + self.value_bias
        logits = tf.einsum("bthk,bshk->bhts", q, k) * (self.head_dim ** -0.5)
        mixed = tf.einsum("bhts,bshk->bthk", tf.nn.softmax(logits, axis=-1), v)
        partial = tf.einsum("bthk,hkd->btd", mixed, self.out)
        return mesh.relayout(partial, (BATCH, None, None), self.mesh) + self.out_bias


class LayerNorm(tf.Module):
    """Layer normalization over the last (whole) dimension; scale and offset replicated."""

    def __init__(self, width: int, epsilon: float = 1e-6, name: Optional[str] = None):
        super().__init__(name=name)
        self.epsilon = epsilon
        self.scale = mesh.variable(lambda: tf.ones([width]), (None,), name="scale")
        self.offset = mesh.variable(lambda: tf.zeros([width]), (None,), name="offset")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(variance + self.epsilon) * self.scale + self.offset


class PatchEmbedding(tf.Module):
    """Image -> patch tokens plus a class token and learned positions (all replicated).

    Args:
      image_size: height = width of the input images.
      patch_size: side of a square patch; must divide image_size.
      channels: input channels.
      width: the embedding width.
      seed: initializer seed.
    """

    def __init__(self, image_size: int, patch_size: int, channels: int, width: int, seed: int,
                 name: Optional[str] = None):
        super().__init__(name=name)
        self.mesh = mesh.current_mesh()
        self.patch_size = patch_size
        self.num_patches = (image_size // patch_size) ** 2
        fan_in = patch_size * patch_size * channels
        self.kernel = mesh.variable(lambda: _glorot(seed, fan_in, width)([fan_in, width]), (None, None),
                                    name="kernel")
        self.bias = mesh.variable(lambda: tf.zeros([width]), (None,), name="bias")
        self.cls = mesh.variable(lambda: tf.zeros([1, 1, width]), (None, None, None), name="cls")
        self.positions = mesh.variable(lambda: truncated_normal(seed + 1, 0.02)([1, self.num_patches + 1, width]),
                                       (None, None, None), name="positions")

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        """images: [batch, H, W, C] split over `batch` -> [batch, 1 + patches, width]."""
        p = self.patch_size
        batch, height, width_px, channels = images.shape
        patches = tf.reshape(images, [batch, height // p, p, width_px // p, p, channels])
        patches = tf.transpose(patches, [0, 1, 3, 2, 4, 5])
        patches = tf.reshape(patches, [batch, self.num_patches, p * p * channels])
        tokens = tf.einsum("bpf,fd->bpd", patches, self.kernel) + self.bias
        cls = tf.tile(self.cls, [batch, 1, 1])
        cls = mesh.relayout(cls, (BATCH, None, None), self.mesh)
        return tf.concat([cls, tokens], axis=1) + self.positions


class ConvStem(tf.Module):
    """3x3 convolutions of stride 2, each followed by layer norm over channels and ReLU
    (replicated: every device convolves its share of the batch with whole kernels).

    The convolutional stem of Xiao et al. 2021 ("Early convolutions help transformers
    see better", arXiv 2106.14881): n such convolutions in front of a patch embedding
    of patch p / 2^n see the image at the same token grid as a plain patch p.

    Args:
      channels: input channels.
      widths: output channels of each convolution, in order.
      seed: initializer seed.
    """

    def __init__(self, channels: int, widths, seed: int, name: Optional[str] = None):
        super().__init__(name=name)
        self.kernels, self.norms = [], []
        for i, out in enumerate(widths):
            fan_in = 9 * channels
            # He initialization (ReLU follows), truncated normal.
            self.kernels.append(mesh.variable(
                lambda f=fan_in, o=out, c=channels, i=i: truncated_normal(seed + i, (2.0 / f) ** 0.5)([3, 3, c, o]),
                (None, None, None, None), name=f"conv{i}"))
            self.norms.append(LayerNorm(out, name=f"norm{i}"))
            channels = out
        self.channels = channels

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        """images: [batch, H, W, C] split over `batch` -> [batch, H / 2^n, W / 2^n, widths[-1]]."""
        x = images
        for kernel, norm in zip(self.kernels, self.norms, strict=True):
            x = tf.nn.relu(norm(tf.nn.conv2d(x, kernel, strides=2, padding="SAME")))
        return x


def replicated_variable(init: Callable, shape, name: Optional[str] = None) -> tf.Variable:
    """A variable held whole by every device of the current mesh (e.g. a classifier head)."""
    return mesh.variable(lambda: init(shape), [None] * len(shape), name=name)
