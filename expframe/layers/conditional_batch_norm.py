"""Class-conditional batch normalisation with cross-replica statistics.

    y = gamma[label] * (x - mean) / sqrt(var + eps) + beta[label]

The normalisation is `SyncBatchNorm` without its own scale and offset: in training
the moments are those of the global batch over all replicas (one collective, see
expframe/layers/sync_batch_norm.py), and the moving statistics, shared by all
classes, are identical on every replica. Each class has its own scale and offset,
rows of two tables [num_classes, channels] looked up by label (de Vries et al.
2017; Miyato & Koyama 2018 use it in the SN-GAN generator). Scales start at 1 and
offsets at 0, so the layer starts as plain batch norm.

Example:
    cbn = ConditionalBatchNorm(num_classes=10)
    y = cbn([x, labels], training=True)          # x [B, H, W, C], labels int [B]
"""

import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.layers.sync_batch_norm import SyncBatchNorm


@keras.saving.register_keras_serializable(package="expframe")
class ConditionalBatchNorm(keras.layers.Layer):
    """Batch norm (global-batch moments) with a per-class scale and offset.

    Args:
      num_classes: number of labels.
      momentum: of the moving statistics (0.9, as Chainer's default decay in the
        official SN-GAN code).
      epsilon: added to the variance (2e-5, likewise).
      group_size: `SyncBatchNorm.group_size` (None: the whole global batch).
    """

    def __init__(self, num_classes: int, momentum: float = 0.9, epsilon: float = 2e-5,
                 group_size=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ConfigError(f"ConditionalBatchNorm num_classes={num_classes!r} must be a positive integer.")
        self.num_classes, self.momentum, self.epsilon, self.group_size = num_classes, momentum, epsilon, group_size
        self.norm = SyncBatchNorm(momentum=momentum, epsilon=epsilon, center=False, scale=False,
                                  group_size=group_size, name="norm")

    def build(self, input_shape):
        x_shape = input_shape[0]
        channels = int(x_shape[-1])
        self.norm.build(x_shape)
        self.gamma = self.add_weight(shape=(self.num_classes, channels), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(self.num_classes, channels), initializer="zeros", name="beta")

    def call(self, inputs, training=None):
        x, labels = inputs
        normalized = self.norm(x, training=training)
        labels = tf.cast(tf.reshape(labels, [-1]), tf.int32)
        # [B, C] -> [B, 1, ..., 1, C] to broadcast over the spatial axes.
        shape = tf.concat([tf.shape(labels), tf.ones([len(x.shape) - 2], tf.int32), [-1]], axis=0)
        gamma = tf.reshape(tf.gather(tf.cast(self.gamma, normalized.dtype), labels), shape)
        beta = tf.reshape(tf.gather(tf.cast(self.beta, normalized.dtype), labels), shape)
        return normalized * gamma + beta

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def get_config(self):
        return dict(super().get_config(), num_classes=self.num_classes, momentum=self.momentum,
                    epsilon=self.epsilon, group_size=self.group_size)
