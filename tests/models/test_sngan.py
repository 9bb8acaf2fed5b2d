"""SN-GAN generator and projection discriminator: shapes, the official widths, spectral
norm placement, and the projection D(x, y) = w.h(x) + embed(y).h(x)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import expframe as xf
from expframe.layers import ConditionalBatchNorm, SNConv2D, SNDense, SNEmbedding
from expframe.models import sngan


def _sn_layers(model):
    return [l for l in model._flatten_layers() if isinstance(l, (SNConv2D, SNDense, SNEmbedding))]  # noqa: E741


@pytest.mark.parametrize("size,blocks_g,blocks_d", [(32, 3, 4), (64, 4, 5), (128, 5, 6)])
def test_shapes_and_blocks_at_each_resolution(size, blocks_g, blocks_d):
    keras.utils.set_random_seed(0)
    g = sngan.sngan_generator(size, num_classes=7, ch=2, z_dim=8)
    d = sngan.sngan_discriminator(size, num_classes=7, ch=2)
    z, y = tf.random.normal([3, 8]), tf.constant([0, 3, 6])
    images = g([z, y], training=True)
    assert images.shape == (3, size, size, 3) and images.dtype == tf.float32
    assert float(tf.reduce_max(tf.abs(images))) <= 1.0
    scores = d([images, y], training=True)
    assert scores.shape == (3,) and scores.dtype == tf.float32
    assert len([l for l in g.layers if isinstance(l, sngan.GeneratorBlock)]) == blocks_g  # noqa: E741
    assert len([l for l in d.layers if isinstance(l, sngan.DiscriminatorBlock)]) == blocks_d  # noqa: E741
    # The generator's last block is ch wide, the discriminator's last ch * 16 (64 and 128 px).
    widths = [l.filters for l in d.layers if isinstance(l, sngan.DiscriminatorBlock)]  # noqa: E741
    assert widths == [m * 2 for m, _ in sngan.DISCRIMINATOR_WIDTHS[size]]


def test_reference_128_widths_match_the_official_code():
    # Generator 1024 -> 64 over 5 up-sampling blocks, discriminator 64 -> 1024 over 6 blocks (ch = 64).
    assert [w * 64 for w in sngan.GENERATOR_WIDTHS[128]] == [1024, 1024, 512, 256, 128, 64]
    assert [w * 64 for w, _ in sngan.DISCRIMINATOR_WIDTHS[128]] == [64, 128, 256, 512, 1024, 1024]
    assert [pool for _, pool in sngan.DISCRIMINATOR_WIDTHS[128]] == [True] * 5 + [False]


def test_spectral_norm_on_the_discriminator_and_optionally_on_the_generator():
    d = sngan.sngan_discriminator(32, num_classes=3, ch=1)
    g = sngan.sngan_generator(32, num_classes=3, ch=1, z_dim=4)
    g_sn = sngan.sngan_generator(32, num_classes=3, ch=1, z_dim=4, spectral_norm=True)
    assert _sn_layers(d) and all(l.use_sn for l in _sn_layers(d))  # noqa: E741
    assert not any(l.use_sn for l in _sn_layers(g))  # noqa: E741
    assert all(l.use_sn for l in _sn_layers(g_sn))  # noqa: E741
    assert any("sn_u" in w.path for w in d.weights) and not any("sn_u" in w.path for w in g.weights)
    # Class-conditional batch norm in every generator block (2 per block).
    assert len([l for l in g._flatten_layers() if isinstance(l, ConditionalBatchNorm)]) == 6  # noqa: E741


def test_the_discriminator_projects_the_class_embedding():
    keras.utils.set_random_seed(1)
    d = sngan.sngan_discriminator(32, num_classes=4, ch=1)
    x = tf.random.uniform([2, 32, 32, 3], -1, 1)
    features = keras.Model(d.inputs, d.get_layer("sum_pool").output)([x, tf.zeros([2], tf.int32)])
    linear, embedding = d.get_layer("linear"), d.get_layer("embedding")
    w, e = linear.normalized_kernel().numpy(), embedding.normalized_kernel().numpy()
    for label in range(4):
        y = tf.fill([2], label)
        want = features.numpy() @ w[:, 0] + linear.bias.numpy()[0] + (features.numpy() * e[label]).sum(-1)
        np.testing.assert_allclose(d([x, y], training=False).numpy(), want, rtol=1e-5, atol=1e-5)


def test_class_input_conditions_the_generator_from_the_start():
    keras.utils.set_random_seed(2)
    z = tf.random.normal([2, 4])
    for class_input in (False, True):
        g = sngan.sngan_generator(32, num_classes=3, ch=1, z_dim=4, class_input=class_input)
        a, b = g([z, tf.constant([0, 0])], training=False), g([z, tf.constant([1, 1])], training=False)
        # At initialisation the batch norms' per-class scales are all 1: only the input differs.
        assert (float(tf.reduce_max(tf.abs(a - b))) > 1e-4) == class_input


def test_widths_override_and_bad_values_are_config_errors():
    g = sngan.sngan_generator(32, num_classes=2, ch=4, z_dim=4, widths=(4, 4, 2, 1))
    assert g.get_layer("block3").filters == 4
    d = sngan.sngan_discriminator(32, num_classes=2, ch=4, widths=(1, 2, 2, 2))
    assert [d.get_layer(f"block{i}").filters for i in range(1, 5)] == [4, 8, 8, 8]
    with pytest.raises(xf.ConfigError, match="sngan_discriminator.widths"):
        sngan.sngan_discriminator(32, num_classes=2, widths=(1, 2))
    with pytest.raises(xf.ConfigError, match="widths"):
        sngan.sngan_generator(32, num_classes=2, widths=(4, 4))
    with pytest.raises(xf.ConfigError, match="image_size=48"):
        sngan.sngan_discriminator(48, num_classes=2)
    with pytest.raises(xf.ConfigError, match="num_classes=0"):
        sngan.sngan_generator(32, num_classes=0)
