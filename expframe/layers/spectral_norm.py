"""Spectral normalisation (Miyato et al. 2018, arXiv 1802.05957) of dense, conv and
embedding kernels, by power iteration.

A layer's kernel W (reshaped to a matrix [fan_in, out]) is used as W / sigma(W),
where sigma is its largest singular value, estimated by one (or more) power
iterations from a persistent vector u [1, out]:

    v = normalise(u W^T),  u = normalise(v W),  sigma = v W u^T

u and v are constants for the gradient (stop_gradient), sigma is not: as in the
paper and its official code, the gradient flows through W / sigma(W). In training
the new u is stored; at eval the same iteration runs from the stored u but
nothing is written, so evaluation does not change the model.

Why not `keras.layers.SpectralNormalization` (Keras 3.15): in training it writes
W / sigma back into the wrapped layer's kernel variable on every call, so the
optimizer then updates the already-normalised kernel and no gradient flows through
sigma (a different algorithm from the paper's), and every call overwrites a
trained weight. Here the kernel is never written; only u is.

Replicas: u is a layer weight (checkpointed with the model, `sn_u`). Every replica
computes the same iteration from the same mirrored kernel and the same u, and
writes its own copy without any communication (u is created under
`identical_updates()`, so `Replicator.scope()` does not average its updates), so u
stays identical on all replicas (tests/layers/test_spectral_norm.py checks it). The kernel is created
with autocast off, so the power iteration runs in float32 under mixed precision;
the normalised kernel is then cast to the layer's compute dtype.

Example:
    conv = SNConv2D(64, 3)                      # spectral norm on
    dense = SNDense(1, use_sn=False)            # a plain dense layer
    emb = SNEmbedding(num_classes, 256)         # the projection discriminator's embedding
"""

import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator.replicator import identical_updates


class _SpectralNormalized(keras.layers.Layer):
    """Base: owns a kernel and, with `use_sn`, the power-iteration vector u."""

    def __init__(self, use_sn: bool = True, power_iterations: int = 1,
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(power_iterations, int) or power_iterations < 1:
            raise ConfigError(f"{type(self).__name__} power_iterations={power_iterations!r} must be an integer >= 1.")
        self.use_sn = bool(use_sn)
        self.power_iterations = power_iterations
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def _add_kernel(self, shape, name="kernel"):
        self.kernel = self.add_weight(shape=shape, initializer=self.kernel_initializer, name=name,
                                      autocast=False)
        if self.use_sn:
            # u ~ N(0, 1), as in the official code; its norm does not matter. Every replica
            # writes the same u (see module docstring): no cross-replica average needed.
            with identical_updates():
                self.sn_u = self.add_weight(shape=(1, shape[-1]), initializer=keras.initializers.RandomNormal(0.0, 1.0),
                                            trainable=False, name="sn_u", autocast=False)

    def sigma(self, training: bool = False) -> tf.Tensor:
        """The estimate of the kernel's largest singular value (stores u if training)."""
        kernel = tf.convert_to_tensor(self.kernel.value)
        w = tf.reshape(kernel, [-1, kernel.shape[-1]])  # [fan_in, out]
        u = tf.convert_to_tensor(self.sn_u.value)
        v = None
        for _ in range(self.power_iterations):
            v = tf.math.l2_normalize(tf.matmul(u, w, transpose_b=True), epsilon=1e-12)  # [1, fan_in]
            u = tf.math.l2_normalize(tf.matmul(v, w), epsilon=1e-12)                    # [1, out]
        u, v = tf.stop_gradient(u), tf.stop_gradient(v)
        if training:
            self.sn_u.assign(u)
        return tf.reshape(tf.matmul(tf.matmul(v, w), u, transpose_b=True), [])

    def normalized_kernel(self, training: bool = False) -> tf.Tensor:
        """W / sigma(W) (or W without spectral norm), in the compute dtype."""
        kernel = tf.convert_to_tensor(self.kernel.value)
        if self.use_sn:
            kernel = kernel / self.sigma(training)
        return tf.cast(kernel, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(use_sn=self.use_sn, power_iterations=self.power_iterations,
                      kernel_initializer=keras.initializers.serialize(self.kernel_initializer))
        return config


@keras.saving.register_keras_serializable(package="expframe")
class SNDense(_SpectralNormalized):
    """Dense layer y = x W / sigma(W) + b (no activation).

    Args:
      units: output features.
      use_bias: add a bias.
      use_sn: spectral normalisation of W (False: a plain dense layer).
      power_iterations: power iterations per call.
      kernel_initializer: Keras initializer of W.
    """

    def __init__(self, units: int, use_bias: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.units, self.use_bias = units, use_bias

    def build(self, input_shape):
        self._add_kernel((int(input_shape[-1]), self.units))
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias") if self.use_bias else None

    def call(self, inputs, training=None):
        y = tf.matmul(tf.cast(inputs, self.compute_dtype), self.normalized_kernel(bool(training)))
        return y + self.bias if self.use_bias else y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        return dict(super().get_config(), units=self.units, use_bias=self.use_bias)


@keras.saving.register_keras_serializable(package="expframe")
class SNConv2D(_SpectralNormalized):
    """Stride-1 'same' 2-D convolution with kernel W / sigma(W) (channels last).

    The kernel [k, k, in, out] is normalised as the matrix [k * k * in, out].

    Args:
      filters: output channels.
      kernel_size: side of the square kernel.
      use_bias, use_sn, power_iterations, kernel_initializer: as `SNDense`.
    """

    def __init__(self, filters: int, kernel_size: int = 3, use_bias: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.kernel_size, self.use_bias = filters, kernel_size, use_bias

    def build(self, input_shape):
        self._add_kernel((self.kernel_size, self.kernel_size, int(input_shape[-1]), self.filters))
        self.bias = self.add_weight(shape=(self.filters,), initializer="zeros", name="bias") if self.use_bias else None

    def call(self, inputs, training=None):
        y = tf.nn.conv2d(tf.cast(inputs, self.compute_dtype), self.normalized_kernel(bool(training)),
                         strides=1, padding="SAME")
        return y + self.bias if self.use_bias else y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.filters,)

    def get_config(self):
        return dict(super().get_config(), filters=self.filters, kernel_size=self.kernel_size,
                    use_bias=self.use_bias)


@keras.saving.register_keras_serializable(package="expframe")
class SNEmbedding(_SpectralNormalized):
    """Embedding lookup in a table E [input_dim, output_dim] used as E / sigma(E).

    Args:
      input_dim: number of ids (classes).
      output_dim: embedding size.
      use_sn, power_iterations, kernel_initializer: as `SNDense`.
    """

    def __init__(self, input_dim: int, output_dim: int, **kwargs):
        kwargs.setdefault("kernel_initializer", "glorot_uniform")
        super().__init__(**kwargs)
        self.input_dim, self.output_dim = input_dim, output_dim

    def build(self, input_shape=None):
        self._add_kernel((self.input_dim, self.output_dim), name="embeddings")

    def call(self, inputs, training=None):
        return tf.gather(self.normalized_kernel(bool(training)), tf.cast(inputs, tf.int32))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        return dict(super().get_config(), input_dim=self.input_dim, output_dim=self.output_dim)

