"""ResNet family: sizes, shapes, initialisation, norm choice, v1.5 strides, gin."""

import gin
import keras
import numpy as np
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.layers import SyncBatchNorm
from expframe.models.resnet import ZeroPadShortcut, resnet
from tests.support import TestCase


def _counts(model):
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    return model.count_params(), trainable


def _norm_layers(model):
    return [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]


def _is_last_in_branch(name, bottleneck):
    return name.endswith("_bn3" if bottleneck else "_bn2")


class ResNetTest(TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.resnet50 = resnet(depth=50, num_classes=1000, input_shape=(224, 224, 3))

    def test_resnet50_parameter_count(self):
        total, trainable = _counts(self.resnet50)
        print(f"resnet50: {total:,} parameters, {trainable:,} trainable")
        # 25,557,032 is torchvision's resnet50 (all trainable); Keras also counts the
        # 53,120 BN moving statistics (2 x 26,560 channels) as non-trainable weights.
        self.assertEqual(trainable, 25_557_032)
        self.assertEqual(total - trainable, 53_120)
        self.assertEqual(total, 25_610_152)

    def test_resnet50_is_v1_5(self):
        layer = self.resnet50.get_layer
        self.assertEqual(layer("stage2_block1_conv1").strides, (1, 1))  # 1x1
        self.assertEqual(layer("stage2_block1_conv2").kernel_size, (3, 3))
        self.assertEqual(layer("stage2_block1_conv2").strides, (2, 2))  # the 3x3 carries the stride
        self.assertEqual(layer("stage2_block1_proj_conv").strides, (2, 2))
        self.assertEqual(layer("stage2_block2_conv2").strides, (1, 1))
        self.assertEqual(self.resnet50.get_layer("stage1_block1_conv2").strides, (1, 1))

    def test_resnet18_output_shape(self):
        model = resnet(depth=18, num_classes=7, input_shape=(64, 64, 3))
        self.assertEqual(_counts(model)[1], 11_689_512 - 1000 * 512 - 1000 + 7 * 512 + 7)
        logits = model(tf.random.normal([2, 64, 64, 3]), training=False)
        self.assertEqual(logits.shape, (2, 7))
        self.assertEqual(logits.dtype, tf.float32)

    def test_cifar_resnet20(self):
        model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3))
        total, trainable = _counts(model)
        print(f"cifar resnet20: {total:,} parameters, {trainable:,} trainable")
        self.assertEqual(trainable, 269_722)  # He et al. 2016, Table 6: 0.27M
        self.assertEqual(total, 271_098)
        self.assertEqual(model(tf.random.normal([3, 32, 32, 3]), training=True).shape, (3, 10))
        self.assertEqual(model.get_layer("stem_conv").kernel_size, (3, 3))
        self.assertEqual(model.get_layer("stage3_block3_conv2").filters, 64)
        self.assertEqual(model.layers[-3].output.shape[1:], (8, 8, 64))  # last block's output

    def test_zero_init_residual(self):
        for model, bottleneck in ((self.resnet50, True),
                                  (resnet(depth=20, num_classes=10, input_shape=(32, 32, 3)), False)):
            norms = _norm_layers(model)
            zeroed = [layer for layer in norms if _is_last_in_branch(layer.name, bottleneck)]
            self.assertEqual(len(zeroed), 16 if bottleneck else 9)
            for layer in norms:
                want = 0.0 if layer in zeroed else 1.0
                np.testing.assert_array_equal(layer.gamma.numpy(), want, err_msg=layer.name)

    def test_zero_init_residual_off(self):
        model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3), zero_init_residual=False)
        for layer in _norm_layers(model):
            np.testing.assert_array_equal(layer.gamma.numpy(), 1.0, err_msg=layer.name)

    def test_norm_options(self):
        model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3), bn_momentum=0.99, bn_epsilon=1e-3)
        for layer in _norm_layers(model):
            self.assertEqual((layer.momentum, layer.epsilon), (0.99, 1e-3))
        self.assertEqual(_norm_layers(self.resnet50)[0].momentum, 0.9)
        self.assertEqual(_norm_layers(self.resnet50)[0].epsilon, 1e-5)

    def test_sync_batch_norm_matches_batch_norm_on_one_device(self):
        plain = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3))
        sync = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3), norm=SyncBatchNorm)
        norms = _norm_layers(sync)
        self.assertTrue(norms and all(isinstance(layer, SyncBatchNorm) for layer in norms))
        rng = np.random.default_rng(0)
        # Non-trivial gammas, betas and moving statistics, so every path is exercised.
        weights = [w + rng.uniform(0.5, 1.5, w.shape).astype(w.dtype) for w in plain.get_weights()]
        plain.set_weights(weights)
        sync.set_weights(weights)
        images = tf.random.normal([4, 32, 32, 3], seed=1)
        for training in (True, False):
            self.assertAllClose(sync(images, training=training), plain(images, training=training),
                                rtol=1e-5, atol=1e-5)
        # Training also moved the moving statistics identically.
        for a, b in zip(sync.non_trainable_weights, plain.non_trainable_weights, strict=True):
            self.assertAllClose(a, b, rtol=1e-6, atol=1e-6)

    def test_width_multiplier(self):
        model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3), width_multiplier=2)
        self.assertEqual(model.get_layer("stem_conv").filters, 32)
        self.assertEqual(model.get_layer("stage3_block1_conv1").filters, 128)

    def test_float32_logits_under_mixed_precision(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3))
            self.assertEqual(model.get_layer("stage1_block1_conv1").compute_dtype, "float16")
            self.assertEqual(model(tf.random.normal([2, 32, 32, 3])).dtype, tf.float32)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    def test_he_fan_out_initialisation(self):
        kernel = self.resnet50.get_layer("stage4_block1_conv2").kernel.numpy()  # 3x3x512x512
        fan_out = 3 * 3 * 512
        self.assertAllClose(kernel.std(), np.sqrt(2.0 / fan_out), rtol=0.02)

    def test_zero_pad_shortcut(self):
        x = tf.random.normal([2, 8, 8, 4])
        layer = ZeroPadShortcut(8, 2)
        y = layer(x).numpy()
        self.assertEqual(y.shape, (2, 4, 4, 8))
        self.assertAllEqual(y[..., 2:6], x.numpy()[:, ::2, ::2, :])
        np.testing.assert_array_equal(y[..., :2], 0.0)
        np.testing.assert_array_equal(y[..., 6:], 0.0)
        self.assertEqual(ZeroPadShortcut.from_config(layer.get_config()).filters, 8)

    def test_serialisable(self):
        model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3), norm=SyncBatchNorm)
        clone = keras.Model.from_config(model.get_config())
        clone.set_weights(model.get_weights())
        images = tf.random.normal([2, 32, 32, 3])
        self.assertAllClose(clone(images), model(images))

    def test_unknown_depth_is_a_config_error(self):
        with self.assertRaisesRegex(ConfigError, r"resnet.depth=42 .*\[18, 34, 50, 101, 152\]"):
            resnet(depth=42, num_classes=10)

    def test_gin_bindings(self):
        gin.parse_config("""
            resnet.depth = 20
            resnet.num_classes = 10
            resnet.input_shape = (32, 32, 3)
            resnet.zero_init_residual = False
        """)
        model = resnet()
        self.assertEqual(model.name, "resnet20")
        self.assertEqual(model.output.shape, (None, 10))
        np.testing.assert_array_equal(model.get_layer("stage1_block1_bn2").gamma.numpy(), 1.0)


class StemStrideTest(tf.test.TestCase):

    def test_stem_stride_halves_every_stage(self):
        plain = resnet(depth=8, num_classes=10, input_shape=(32, 32, 3))
        strided = resnet(depth=8, num_classes=10, input_shape=(32, 32, 3), stem_stride=2)
        self.assertEqual(plain.get_layer("stem_conv").output.shape[1], 32)
        self.assertEqual(strided.get_layer("stem_conv").output.shape[1], 16)
        self.assertEqual(strided.count_params(), plain.count_params())
        self.assertEqual(strided(tf.zeros([2, 32, 32, 3])).shape, (2, 10))
        with self.assertRaisesRegex(ConfigError, "resnet.stem_stride=3"):
            resnet(depth=8, num_classes=10, input_shape=(32, 32, 3), stem_stride=3)
