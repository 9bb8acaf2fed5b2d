"""The ResNet generator and projection discriminator of SN-GAN (plain Keras, no hardware code).

Miyato & Koyama 2018, "cGANs with Projection Discriminator" (arXiv 1802.05637), and
its official code (github.com/pfnet-research/sngan_projection): the class-conditional
ResNet GAN that reached an Inception Score of 29.7 on ImageNet 128x128 at 450K steps.

Generator (`sngan_generator`): z [z_dim] -> dense to 4x4 x (ch * m0) -> residual
up-sampling blocks -> batch norm, ReLU, 3x3 conv to RGB, tanh (images in [-1, 1]).
Each block: CBN, ReLU, nearest 2x up-sample, 3x3 conv, CBN, ReLU, 3x3 conv; shortcut
up-sample then 1x1 conv. CBN is `ConditionalBatchNorm` (per-class scale and offset,
moments over the global batch of all replicas). Spectral norm optional (off in the
paper).

Discriminator (`sngan_discriminator`): an "optimised" first block (3x3 conv, ReLU,
3x3 conv, 2x2 average pool; shortcut pool then 1x1 conv), residual blocks (ReLU,
3x3 conv to the block's input width, ReLU, 3x3 conv, optional pool; shortcut 1x1
conv then pool where the shape changes), ReLU, sum over space, then

    D(x, y) = w . h(x) + embed(y) . h(x)          (the projection)

with spectral norm on every conv, dense and embedding kernel (on by default).

Widths, as multiples of `ch` (the official settings use ch = 64 at 64 and 128 px;
for 32 px they are the SN-GAN CIFAR ResNets: G 256 = 4 x 64 wide, D 128 = 2 x 64):

| size | generator: dense, then each block's output | discriminator blocks (width, pool) |
|------|---------------------------------------------|------------------------------------|
| 32   | 4; 4, 4, 4 (3 blocks)                       | 2 p, 2 p, 2, 2                     |
| 64   | 16; 8, 4, 2, 1 (4 blocks)                   | 1 p, 2 p, 4 p, 8 p, 16 p           |
| 128  | 16; 16, 8, 4, 2, 1 (5 blocks)               | 1 p, 2 p, 4 p, 8 p, 16 p, 16       |

Initialisation as in the official code: Glorot uniform with gain sqrt(2) on the
residual convs, gain 1 on shortcuts, dense layers and the last conv. Unlike the
official code, the generator has no biases where a batch norm follows (all but the
last conv's): the norm cancels them, so the function is the same, and their
rounding-noise gradients are not turned into steps of size ~lr by Adam.

Example:
    g = sngan_generator(image_size=32, num_classes=10, ch=16)
    d = sngan_discriminator(image_size=32, num_classes=10, ch=16)
    images = g([z, labels], training=True)       # [B, 32, 32, 3] in [-1, 1]
    scores = d([images, labels], training=True)  # [B]
"""

import functools
from typing import Optional, Sequence

import gin
import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.layers.conditional_batch_norm import ConditionalBatchNorm
from expframe.layers.spectral_norm import SNConv2D, SNDense, SNEmbedding
from expframe.layers.sync_batch_norm import SyncBatchNorm

GENERATOR_WIDTHS = {32: (4, 4, 4, 4), 64: (16, 8, 4, 2, 1), 128: (16, 16, 8, 4, 2, 1)}
DISCRIMINATOR_WIDTHS = {
    32: ((2, True), (2, True), (2, False), (2, False)),
    64: ((1, True), (2, True), (4, True), (8, True), (16, True)),
    128: ((1, True), (2, True), (4, True), (8, True), (16, True), (16, False)),
}
BOTTOM_WIDTH = 4  # the generator starts at 4x4


def _residual_init():
    # Glorot uniform with gain sqrt(2) (variance scale 2) for convs followed by ReLUs.
    return keras.initializers.VarianceScaling(scale=2.0, mode="fan_avg", distribution="uniform")


def _upsample(x):
    return tf.repeat(tf.repeat(x, 2, axis=1), 2, axis=2)  # nearest neighbour, 2x


def _downsample(x):
    return tf.nn.avg_pool2d(x, 2, 2, "VALID")


@keras.saving.register_keras_serializable(package="expframe")
class GeneratorBlock(keras.layers.Layer):
    """Residual up-sampling block with class-conditional batch norm; call([x, labels])."""

    def __init__(self, filters: int, num_classes: int, use_sn: bool = False, group_size: Optional[int] = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.filters, self.num_classes, self.use_sn, self.group_size = filters, num_classes, use_sn, group_size
        self.bn1 = ConditionalBatchNorm(num_classes, group_size=group_size, name="bn1")
        # No biases: every output here feeds a batch norm, which would cancel them.
        conv = functools.partial(SNConv2D, use_sn=use_sn, use_bias=False)
        self.conv1 = conv(filters, 3, kernel_initializer=_residual_init(), name="conv1")
        self.bn2 = ConditionalBatchNorm(num_classes, group_size=group_size, name="bn2")
        self.conv2 = conv(filters, 3, kernel_initializer=_residual_init(), name="conv2")
        self.shortcut = conv(filters, 1, name="shortcut")

    def build(self, input_shape):
        x_shape, y_shape = input_shape
        up = (x_shape[0], x_shape[1] * 2, x_shape[2] * 2, x_shape[3])
        self.bn1.build([x_shape, y_shape])
        self.conv1.build(up)
        self.bn2.build([up[:3] + (self.filters,), y_shape])
        self.conv2.build(up[:3] + (self.filters,))
        self.shortcut.build(up)

    def call(self, inputs, training=None):
        x, labels = inputs
        h = tf.nn.relu(self.bn1([x, labels], training=training))
        h = self.conv1(_upsample(h), training=training)
        h = tf.nn.relu(self.bn2([h, labels], training=training))
        h = self.conv2(h, training=training)
        return h + self.shortcut(_upsample(x), training=training)

    def compute_output_shape(self, input_shape):
        x_shape = input_shape[0]
        return (x_shape[0], x_shape[1] * 2, x_shape[2] * 2, self.filters)

    def get_config(self):
        return dict(super().get_config(), filters=self.filters, num_classes=self.num_classes, use_sn=self.use_sn,
                    group_size=self.group_size)


@keras.saving.register_keras_serializable(package="expframe")
class DiscriminatorBlock(keras.layers.Layer):
    """Residual block of the discriminator; `first` is the official "optimised" block."""

    def __init__(self, filters: int, downsample: bool = True, first: bool = False, use_sn: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.downsample, self.first, self.use_sn = filters, downsample, first, use_sn
        self.conv1 = self.conv2 = self.shortcut = None

    def build(self, input_shape):
        in_channels = int(input_shape[-1])
        hidden = self.filters if self.first else in_channels  # official: hidden = in_channels
        self.conv1 = SNConv2D(hidden, 3, use_sn=self.use_sn, kernel_initializer=_residual_init(), name="conv1")
        self.conv2 = SNConv2D(self.filters, 3, use_sn=self.use_sn, kernel_initializer=_residual_init(), name="conv2")
        self.conv1.build(input_shape)
        self.conv2.build(tuple(input_shape[:3]) + (hidden,))
        if self.first or self.downsample or in_channels != self.filters:
            self.shortcut = SNConv2D(self.filters, 1, use_sn=self.use_sn, name="shortcut")
            self.shortcut.build(tuple(input_shape[:3]) + (in_channels,))

    def call(self, x, training=None):
        h = x if self.first else tf.nn.relu(x)
        h = self.conv2(tf.nn.relu(self.conv1(h, training=training)), training=training)
        if self.downsample:
            h = _downsample(h)
        if self.first:  # pool, then 1x1 conv
            return h + self.shortcut(_downsample(x), training=training)
        s = x
        if self.shortcut is not None:
            s = self.shortcut(s, training=training)
            if self.downsample:
                s = _downsample(s)
        return h + s

    def compute_output_shape(self, input_shape):
        f = 2 if self.downsample else 1
        return (input_shape[0], input_shape[1] // f, input_shape[2] // f, self.filters)

    def get_config(self):
        return dict(super().get_config(), filters=self.filters, downsample=self.downsample,
                    first=self.first, use_sn=self.use_sn)


def _check(image_size, num_classes, ch, name):
    if image_size not in GENERATOR_WIDTHS:
        raise ConfigError(f"{name}: image_size={image_size!r} is not supported; use one of "
                          f"{', '.join(map(str, GENERATOR_WIDTHS))} (set GANTask.image_size).")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"{name}: num_classes={num_classes!r} must be a positive integer (GANTask.num_classes).")
    if not isinstance(ch, int) or ch < 1:
        raise ConfigError(f"{name}.ch={ch!r} must be a positive integer.")


@gin.configurable
def sngan_generator(image_size: int, num_classes: int, ch: int = 64, z_dim: int = 128,
                    spectral_norm: bool = False, widths: Optional[Sequence[int]] = None,
                    class_input: bool = False, bn_group_size: Optional[int] = None) -> keras.Model:
    """The class-conditional ResNet generator.

    Args:
      image_size: 32, 64 or 128 (output [image_size, image_size, 3]).
      num_classes: labels (the task passes it).
      ch: base width (see the table in the module docstring).
      z_dim: noise dimension.
      spectral_norm: spectral norm on the generator's kernels too (off in the paper).
      widths: multiples of `ch` for the dense layer and each block, replacing the
        table's (its length fixes the blocks: 4 * 2**(len - 1) must be image_size).
      class_input: also feed the one-hot label to the first dense layer, beside z
        (not in the paper, where labels enter through the batch norms only; it lets
        a short run separate the classes sooner).
      bn_group_size: `SyncBatchNorm.group_size` of every batch norm: the replicas whose
        batch statistics each normalises with (None: the whole global batch).

    Returns:
      A Keras model: [z float [B, z_dim], labels int [B]] -> images float32 [B, H, W, 3] in [-1, 1].
    """
    _check(image_size, num_classes, ch, "sngan_generator")
    if not isinstance(z_dim, int) or z_dim < 1:
        raise ConfigError(f"sngan_generator.z_dim={z_dim!r} must be a positive integer.")
    multiples = tuple(GENERATOR_WIDTHS[image_size] if widths is None else widths)
    if len(multiples) != len(GENERATOR_WIDTHS[image_size]) or not all(isinstance(m, int) and m > 0 for m in multiples):
        raise ConfigError(f"sngan_generator.widths={widths!r}: give {len(GENERATOR_WIDTHS[image_size])} positive "
                          f"integers for image_size {image_size} (the dense layer, then each up-sampling block).")
    widths = [m * ch for m in multiples]
    z = keras.Input((z_dim,), name="z")
    labels = keras.Input((), dtype="int32", name="labels")
    h = z
    if class_input:
        onehot = keras.layers.Lambda(lambda y: tf.one_hot(y, num_classes), output_shape=(num_classes,),
                                     name="onehot")(labels)
        h = keras.layers.Concatenate(name="z_and_class")([z, onehot])
    h = SNDense(BOTTOM_WIDTH * BOTTOM_WIDTH * widths[0], use_sn=spectral_norm, use_bias=False, name="dense")(h)
    h = keras.layers.Reshape((BOTTOM_WIDTH, BOTTOM_WIDTH, widths[0]))(h)
    for i, width in enumerate(widths[1:], start=1):
        h = GeneratorBlock(width, num_classes, use_sn=spectral_norm, group_size=bn_group_size,
                           name=f"block{i}")([h, labels])
    h = SyncBatchNorm(momentum=0.9, epsilon=2e-5, group_size=bn_group_size, name="bn")(h)
    h = keras.layers.ReLU()(h)
    h = SNConv2D(3, 3, use_sn=spectral_norm, name="to_rgb")(h)
    images = keras.layers.Activation("tanh", dtype="float32", name="images")(h)
    return keras.Model([z, labels], images, name="generator")


@gin.configurable
def sngan_discriminator(image_size: int, num_classes: int, ch: int = 64, spectral_norm: bool = True,
                        widths: Optional[Sequence[int]] = None) -> keras.Model:
    """The ResNet discriminator with the projection of the class embedding.

    Args:
      image_size: 32, 64 or 128.
      num_classes: labels (the task passes it).
      ch: base width (see the table in the module docstring).
      spectral_norm: spectral norm on every kernel (the paper: on).
      widths: multiples of `ch` for each block, replacing the table's (same length;
        where the blocks pool stays as in the table).

    Returns:
      A Keras model: [images float [B, H, W, 3], labels int [B]] -> scores float32 [B].
    """
    _check(image_size, num_classes, ch, "sngan_discriminator")
    table = DISCRIMINATOR_WIDTHS[image_size]
    multiples = tuple(w for w, _ in table) if widths is None else tuple(widths)
    if len(multiples) != len(table) or not all(isinstance(m, int) and m > 0 for m in multiples):
        raise ConfigError(f"sngan_discriminator.widths={widths!r}: give {len(table)} positive integers for "
                          f"image_size {image_size} (one per block).")
    images = keras.Input((image_size, image_size, 3), name="images")
    labels = keras.Input((), dtype="int32", name="labels")
    h = images
    for i, (width, (_, pool)) in enumerate(zip(multiples, table, strict=True)):
        h = DiscriminatorBlock(width * ch, downsample=pool, first=(i == 0), use_sn=spectral_norm,
                               name=f"block{i + 1}")(h)
    h = keras.layers.ReLU()(h)
    features = keras.layers.Lambda(lambda t: tf.reduce_sum(t, axis=[1, 2]), name="sum_pool")(h)
    unconditional = SNDense(1, use_sn=spectral_norm, name="linear")(features)
    embedded = SNEmbedding(num_classes, features.shape[-1], use_sn=spectral_norm, name="embedding")(labels)
    projection = keras.layers.Lambda(lambda t: tf.reduce_sum(t[0] * t[1], axis=-1), name="projection")(
        [embedded, features])
    unconditional = keras.layers.Reshape(())(unconditional)
    scores = keras.layers.Add(dtype="float32", name="scores")([unconditional, projection])
    return keras.Model([images, labels], scores, name="discriminator")
