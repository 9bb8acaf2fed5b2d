"""expframe/data/raw_images.py: a dataset's declared eval preprocessing of one raw image
follows the dataset's gin bindings of the moment and is what its eval pipeline computes
(the served signatures: tests/test_export_classifier.py)."""

import gin
import numpy as np
import tensorflow as tf

from expframe.data import imagenet, inputs, raw_images
from tests.support import clean_gin  # noqa: F401  (autouse: gin cleared around each test)

RNG = np.random.default_rng(0)


def _pixels(height, width):
    return RNG.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def test_shapes_follows_its_bindings():
    image = _pixels(32, 32)
    raw = raw_images.of(inputs.shapes_input)
    np.testing.assert_array_equal(raw.preprocess(image), tf.image.per_image_standardization(image.astype(np.float32)))
    assert raw.class_names[:3] == ("circle", "square", "triangle") and len(raw.class_names) == 10
    gin.parse_config(["shapes_input.standardize = False", "shapes_input.image_size = 64"])
    raw = raw_images.of(inputs.shapes_input)
    resized = tf.image.resize(image, [64, 64], method="bilinear", antialias=True)
    np.testing.assert_array_equal(raw.preprocess(image), resized / 127.5 - 1.0)  # resized: not the set's size
    same = _pixels(64, 64)
    np.testing.assert_array_equal(raw.preprocess(same), same.astype(np.float32) / 127.5 - 1.0)  # its size: as is
    np.testing.assert_array_equal(raw.decode(tf.io.encode_png(same)), raw.preprocess(same))


def test_imagenet_follows_its_bindings_and_decodes_jpeg_in_the_crop_window():
    gin.parse_config(["imagenet_input.image_size = 40", "imagenet_input.dtype = 'bfloat16'"])
    raw = raw_images.of(imagenet.imagenet_input)
    assert len(raw.class_names) == 1000 and raw.class_names[0] == "n01440764"
    image = _pixels(70, 50)
    want = imagenet.preprocess_for_eval(tf.constant(image), 40, tf.bfloat16)
    got = raw.preprocess(image)
    assert got.dtype == tf.float32 and got.shape == (40, 40, 3)
    np.testing.assert_array_equal(got, tf.cast(want, tf.float32))
    np.testing.assert_array_equal(raw.decode(tf.io.encode_png(image)), got)
    jpeg = tf.io.encode_jpeg(image, quality=90)
    np.testing.assert_array_equal(raw.decode(jpeg), tf.cast(imagenet.preprocess_for_eval(jpeg, 40, tf.bfloat16),
                                                            tf.float32))


def test_a_dataset_without_a_declaration_has_none():
    assert raw_images.of(lambda **_: None) is None and raw_images.of(None) is None
