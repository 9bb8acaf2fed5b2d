"""A convolutional encoder for pixel observations: DrQ's (the SAC-AE encoder).

From Kostrikov, Yarats & Fergus 2020 (DrQ, arXiv 2004.13649), the encoder of Yarats et al.
2019 (SAC-AE, arXiv 1910.01741), as in github.com/denisyarats/drq `drq.py` `Encoder`:

    pixels / 255 -> Conv(32, 3x3, stride 2) -> ReLU -> 3 x [Conv(32, 3x3, stride 1) -> ReLU]
    (no padding) -> flatten -> Linear(50) -> LayerNorm -> tanh

with convolutions initialised orthogonally at ReLU gain sqrt(2), the linear layer
orthogonally, biases 0 (`utils.weight_init`). At 64x64 the convolutions end at 25x25x32,
20,000 values, so the linear layer holds most of its 1.0 M parameters.

D4PG uses it as Acme's D4PG uses an observation network (`D4PGTask.observation_network`,
`expframe/tasks/d4pg_observations.py`): the critic trains it, the policy reads its
features with gradients stopped (DrQ's actor likewise detaches the convolutions), and
the policy and critic networks are `d4pg_policy` and `d4pg_critic` over its 50 features.
Frames arrive as uint8 and are scaled here; nothing here knows about devices.

Example:
    encoder = drq_encoder(observation_shape=(64, 64, 9))     # 3 stacked RGB frames
    features = encoder(frames)                               # uint8 [batch, 64, 64, 9] -> [batch, 50]
"""

from typing import Sequence

import gin
import keras
import numpy as np

from expframe.errors import ConfigError


@gin.configurable
def drq_encoder(observation_shape: Sequence[int], num_filters: int = 32, num_layers: int = 4,
                feature_size: int = 50) -> keras.Model:
    """DrQ's pixel encoder: uint8 [batch, H, W, C] -> features in (-1, 1) [batch, feature_size].

    Args:
      observation_shape: (H, W, C) of one observation (C = 3 x frames stacked).
      num_filters: channels of every convolution (DrQ: 32).
      num_layers: convolutions, the first with stride 2 (DrQ: 4).
      feature_size: width of the LayerNorm-tanh output (DrQ: 50).
    """
    for binding, value in (("num_filters", num_filters), ("num_layers", num_layers), ("feature_size", feature_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"drq_encoder.{binding}={value!r} must be a positive integer.")
    height, width = int(observation_shape[0]), int(observation_shape[1])
    if min(height, width) - 1 < 2 * num_layers:
        raise ConfigError(f"drq_encoder.num_layers={num_layers} is too many for {height}x{width} frames "
                          "(the first 3x3 convolution halves the size, each other takes 2 pixels off).")
    pixels = keras.Input(tuple(observation_shape), dtype="uint8", name="pixels")
    x = keras.layers.Rescaling(1.0 / 255.0, name="encoder_scale")(pixels)
    relu_gain = keras.initializers.Orthogonal(gain=float(np.sqrt(2.0)))   # torch's calculate_gain('relu')
    for i in range(num_layers):
        x = keras.layers.Conv2D(num_filters, 3, strides=2 if i == 0 else 1, padding="valid", activation="relu",
                                kernel_initializer=relu_gain, name=f"encoder_conv{i}")(x)
    x = keras.layers.Flatten(name="encoder_flatten")(x)
    x = keras.layers.Dense(feature_size, kernel_initializer=keras.initializers.Orthogonal(), name="encoder_linear")(x)
    x = keras.layers.LayerNormalization(name="encoder_layer_norm")(x)
    features = keras.layers.Activation("tanh", dtype="float32", name="encoder_tanh")(x)
    return keras.Model(pixels, features, name="drq_encoder")
