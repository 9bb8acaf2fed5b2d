"""ResNets as plain Keras functional models (no hardware code).

Two families, chosen by depth:
  * ImageNet (He et al. 2016, "Deep Residual Learning", Table 1): depths 18, 34
    (basic blocks) and 50, 101, 152 (bottleneck blocks); 7x7/2 conv stem and 3x3/2
    max-pool, four stages of 64/128/256/512 base channels, for 224x224 inputs.
    Bottleneck ResNets are "v1.5": a stage's stride sits on the 3x3 conv, not on
    the first 1x1 conv (as in torchvision and NVIDIA's / Goyal et al.'s recipes).
    Shortcuts are identity, or 1x1 conv + norm where the shape changes (option B).
  * CIFAR (same paper, Section 4.2): depths 6n+2 (20, 32, 44, 56, 110), a 3x3/1 stem,
    three stages of 16/32/64 channels of n basic blocks each, for 32x32 inputs.
    Shortcuts are parameter-free (option A: subsample and zero-pad channels), which
    gives the paper's 0.27M parameters for ResNet-20.

Initialisation: convs use He normal with fan_out (variance 2/fan_out, untruncated,
as torchvision's kaiming_normal_(mode="fan_out")); the final Dense uses N(0, 0.01^2)
and zero bias (Goyal et al. 2017). With `zero_init_residual` the last norm layer of
every residual branch starts with gamma = 0, so each block starts as the identity.

Layer names: `stem_conv`, `stem_bn`, `stage{s}_block{b}_conv{k}` / `_bn{k}` for the k-th
conv/norm of the residual branch, `stage{s}_block{b}_proj_conv` / `_proj_bn` for a
projection shortcut, `logits`. Stages count from 1, blocks from 1.

Example:
    model = resnet(depth=50, num_classes=1000, input_shape=(224, 224, 3))
    logits = model(images, training=True)        # float images, already normalised

Gin:
    ClassificationTask.model = @resnet
    resnet.depth = 50
    resnet.norm = @SyncBatchNorm                 # see below
The norm class must be known to gin as `gin.external_configurable(SyncBatchNorm,
module="expframe.layers")`; `gin.configurable` applied to a Keras 3 layer class
breaks it (Keras' Operation.__new__ reads __init__'s argument names, which gin's
wrapper hides), so a layer class cannot be decorated in place.
"""

from typing import Callable, Sequence, Tuple

import gin
import keras

from expframe.errors import ConfigError

# depth -> (blocks per stage, bottleneck?)
IMAGENET_DEPTHS = {
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}
CIFAR_DEPTHS = (8, 14, 20, 32, 44, 56, 110)
_BOTTLENECK_EXPANSION = 4


def _conv_init() -> keras.initializers.Initializer:
    # He et al. 2015: Var(w) = 2 / fan_out keeps the backward signal's variance through ReLUs.
    return keras.initializers.VarianceScaling(scale=2.0, mode="fan_out", distribution="untruncated_normal")


class _Builder:
    """Holds the per-model choices so that the block functions stay short."""

    def __init__(self, norm, zero_init_residual, momentum, epsilon):
        self.norm, self.zero_init_residual = norm, zero_init_residual
        self.momentum, self.epsilon = momentum, epsilon

    def conv(self, x, filters, kernel, strides, name):
        return keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False,
                                   kernel_initializer=_conv_init(), name=name)(x)

    def bn(self, x, name, last_in_branch=False):
        gamma = "zeros" if last_in_branch and self.zero_init_residual else "ones"
        return self.norm(momentum=self.momentum, epsilon=self.epsilon, gamma_initializer=gamma, name=name)(x)

    def conv_bn_relu(self, x, filters, kernel, strides, name, k):
        x = self.conv(x, filters, kernel, strides, f"{name}_conv{k}")
        return keras.layers.ReLU(name=f"{name}_relu{k}")(self.bn(x, f"{name}_bn{k}"))

    def shortcut(self, x, filters, strides, name, zero_pad):
        if strides == 1 and x.shape[-1] == filters:
            return x
        if zero_pad:
            return ZeroPadShortcut(filters, strides, name=f"{name}_pad")(x)
        x = self.conv(x, filters, 1, strides, f"{name}_proj_conv")
        return self.bn(x, f"{name}_proj_bn")

    def basic_block(self, x, filters, strides, name, zero_pad=False):
        shortcut = self.shortcut(x, filters, strides, name, zero_pad)
        y = self.conv_bn_relu(x, filters, 3, strides, name, 1)
        y = self.bn(self.conv(y, filters, 3, 1, f"{name}_conv2"), f"{name}_bn2", last_in_branch=True)
        return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))

    def bottleneck_block(self, x, filters, strides, name):
        out = filters * _BOTTLENECK_EXPANSION
        shortcut = self.shortcut(x, out, strides, name, zero_pad=False)
        y = self.conv_bn_relu(x, filters, 1, 1, name, 1)
        y = self.conv_bn_relu(y, filters, 3, strides, name, 2)  # v1.5: the stride is here.
        y = self.bn(self.conv(y, out, 1, 1, f"{name}_conv3"), f"{name}_bn3", last_in_branch=True)
        return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))


@keras.saving.register_keras_serializable(package="expframe")
class ZeroPadShortcut(keras.layers.Layer):
    """Parameter-free shortcut (He et al. 2016, option A): subsample, zero-pad channels."""

    def __init__(self, filters: int, strides: int, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.strides = filters, strides

    def call(self, x):
        x = x[:, ::self.strides, ::self.strides, :]
        extra = self.filters - x.shape[-1]
        return keras.ops.pad(x, [[0, 0], [0, 0], [0, 0], [extra // 2, extra - extra // 2]])

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "strides": self.strides}


@gin.configurable
def resnet(depth: int = gin.REQUIRED,
           num_classes: int = gin.REQUIRED,
           input_shape: Tuple[int, int, int] = (224, 224, 3),
           norm: Callable[..., keras.layers.Layer] = keras.layers.BatchNormalization,
           zero_init_residual: bool = True,
           width_multiplier: int = 1,
           bn_momentum: float = 0.9,
           bn_epsilon: float = 1e-5,
           stem_stride: int = 1,
           name: str = None) -> keras.Model:
    """Builds a ResNet that maps float images to float32 logits (no softmax).

    Args:
      depth: 18, 34, 50, 101 or 152 for the ImageNet family; 20, 32, 44, 56 or 110
        for the CIFAR family (see the module docstring).
      num_classes: number of logits.
      input_shape: (height, width, channels) of one image, channels last.
      norm: class or callable used for every normalisation layer, called with
        `momentum`, `epsilon`, `gamma_initializer` and `name` (the arguments of
        `keras.layers.BatchNormalization`), e.g. `expframe.layers.SyncBatchNorm`.
      zero_init_residual: start the last norm layer of each residual branch with
        gamma = 0 (Goyal et al. 2017), so every block starts as the identity.
      width_multiplier: multiplies every stage's (and the stem's) channel count.
      bn_momentum: Keras momentum of the moving statistics (moving = m * moving +
        (1 - m) * batch), 0.9 as in torchvision's 0.1.
      bn_epsilon: added to the variance in every norm layer.
      stem_stride: stride of the CIFAR family's 3x3 stem (1 as in the paper; 2 halves
        every stage's resolution: about 4x fewer FLOPs, for small CPU runs).
      name: model name; default `resnet{depth}`.

    Returns:
      A `keras.Model` with its weights created; its last layer is a float32
      Dense, so logits are float32 even under a mixed precision policy.

    Raises:
      ConfigError: `depth` names no known ResNet, or `width_multiplier` < 1.
    """
    if depth not in IMAGENET_DEPTHS and depth not in CIFAR_DEPTHS:
        raise ConfigError(
            f"resnet.depth={depth!r} is not a ResNet depth; use one of {sorted(IMAGENET_DEPTHS)} "
            f"(ImageNet, 224x224) or {list(CIFAR_DEPTHS)} (CIFAR, 32x32).")
    if not isinstance(width_multiplier, int) or width_multiplier < 1:
        raise ConfigError(f"resnet.width_multiplier={width_multiplier!r} must be a positive integer.")
    b = _Builder(norm, zero_init_residual, bn_momentum, bn_epsilon)
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    if depth in IMAGENET_DEPTHS:
        x = _imagenet_trunk(b, inputs, *IMAGENET_DEPTHS[depth], width=64 * width_multiplier)
    else:
        if stem_stride not in (1, 2):
            raise ConfigError(f"resnet.stem_stride={stem_stride!r}: use 1 or 2.")
        x = _cifar_trunk(b, inputs, (depth - 2) // 6, width=16 * width_multiplier, stem_stride=stem_stride)
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    logits = keras.layers.Dense(
        num_classes, kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        bias_initializer="zeros", dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name=name or f"resnet{depth}")


def _imagenet_trunk(b: _Builder, x, blocks: Sequence[int], bottleneck: bool, width: int):
    x = b.conv(x, width, 7, 2, "stem_conv")
    x = keras.layers.ReLU(name="stem_relu")(b.bn(x, "stem_bn"))
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)
    for s, n in enumerate(blocks, start=1):
        filters = width * 2 ** (s - 1)
        for i in range(1, n + 1):
            strides = 2 if s > 1 and i == 1 else 1
            block = b.bottleneck_block if bottleneck else b.basic_block
            x = block(x, filters, strides, f"stage{s}_block{i}")
    return x


def _cifar_trunk(b: _Builder, x, blocks_per_stage: int, width: int, stem_stride: int = 1):
    x = b.conv(x, width, 3, stem_stride, "stem_conv")
    x = keras.layers.ReLU(name="stem_relu")(b.bn(x, "stem_bn"))
    for s in range(1, 4):
        for i in range(1, blocks_per_stage + 1):
            strides = 2 if s > 1 and i == 1 else 1
            x = b.basic_block(x, width * 2 ** (s - 1), strides, f"stage{s}_block{i}", zero_pad=True)
    return x
