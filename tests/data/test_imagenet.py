"""ImageNet pipeline: preprocessing on generated JPEGs, the mock pipeline, errors."""

import os
import socket
from unittest import mock

import gin
import numpy as np
import tensorflow as tf

from expframe.data import imagenet
from expframe.errors import ConfigError
from expframe.replicator.inputs import InputContext
from tests.support import TestCase

MEAN = np.array(imagenet.MEAN_RGB, np.float32)
STD = np.array(imagenet.STDDEV_RGB, np.float32)


def _jpeg(image: np.ndarray) -> tf.Tensor:
    return tf.io.encode_jpeg(tf.constant(image, tf.uint8), quality=100)


def _gradient(height: int, width: int) -> np.ndarray:
    """R grows with x, G with y, B constant: every position looks different."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                     np.full_like(x, 100)], -1).astype(np.uint8)


def _unnormalise(image) -> np.ndarray:
    return np.asarray(image, np.float32) * STD + MEAN


def _seed(i: int) -> tf.Tensor:
    return tf.constant([i, 17], tf.int64)


SIZES = ((480, 640), (375, 500), (300, 200), (50, 1000), (16, 16))


class PreprocessingTest(TestCase):

    def test_train_output_shape_dtype_and_range(self):
        for h, w in SIZES:
            image = imagenet.preprocess_for_train(_jpeg(_gradient(h, w)), _seed(h), image_size=96)
            self.assertEqual(image.shape, (96, 96, 3))
            self.assertEqual(image.dtype, tf.float32)
            pixels = _unnormalise(image)
            self.assertGreaterEqual(pixels.min(), -0.5)
            self.assertLessEqual(pixels.max(), 255.5)
        image = imagenet.preprocess_for_train(_jpeg(_gradient(64, 64)), _seed(0), 32, tf.bfloat16)
        self.assertEqual((image.shape, image.dtype), ((32, 32, 3), tf.bfloat16))

    def test_crop_window_within_bounds_area_and_aspect(self):
        fallbacks = 0
        for h, w in SIZES:
            shape = tf.constant([h, w, 3])
            for i in range(50):
                oy, ox, ch, cw = imagenet.random_crop_window(shape, _seed(i)).numpy()
                self.assertTrue(0 <= oy and oy + ch <= h and 0 <= ox and ox + cw <= w, (h, w, oy, ox, ch, cw))
                if (ch, cw) == (h, w):
                    fallbacks += 1  # the whole image: no crop fitted in 10 tries (or area 1)
                    continue
                # Integer rounding of the crop's sides loosens the bounds slightly.
                self.assertBetween(ch * cw / (h * w), 0.08 * 0.9, 1.0)
                self.assertBetween(cw / ch, 0.75 * 0.85, 4 / 3 / 0.85)
        self.assertLess(fallbacks, 60)  # mostly from the thin 50x1000 image

    def test_fused_decode_crops_the_sampled_window(self):
        pixels = _gradient(240, 320)
        encoded = _jpeg(pixels)
        decoded = tf.io.decode_jpeg(encoded, channels=3)
        for i in range(5):
            window = imagenet.random_crop_window(tf.constant([240, 320, 3]), _seed(i))
            oy, ox, ch, cw = window.numpy()
            fused = imagenet._crop(encoded, window).numpy().astype(np.float32)
            self.assertEqual(fused.shape, (ch, cw, 3))
            # The crop shows the pattern of its window: R encodes x, G encodes y.
            expected = pixels[oy:oy + ch, ox:ox + cw].astype(np.float32)
            self.assertLess(np.abs(fused - expected).mean(), 2.0)
            # And the decoded-image path (used for mocks that yield arrays) agrees.
            sliced = imagenet._crop(decoded, window).numpy().astype(np.float32)
            self.assertLess(np.abs(fused - sliced).max(), 3.0)
        # Whole pipeline: encoded and decoded inputs give the same training image.
        self.assertAllClose(imagenet.preprocess_for_train(encoded, _seed(3), 64),
                            imagenet.preprocess_for_train(decoded, _seed(3), 64), atol=0.1)

    def test_train_randomness_is_seeded(self):
        encoded = _jpeg(_gradient(120, 160))
        a = imagenet.preprocess_for_train(encoded, _seed(1), 64)
        self.assertAllEqual(a, imagenet.preprocess_for_train(encoded, _seed(1), 64))
        self.assertNotAllClose(a, imagenet.preprocess_for_train(encoded, _seed(2), 64))

    def test_eval_centre_crop(self):
        # 256x320 image: black, with a white 224x224 square in the centre; the eval crop
        # at 224 (shorter side 256 -> 256, centre 224) is exactly the white square.
        pixels = np.zeros((256, 320, 3), np.uint8)
        pixels[16:240, 48:272] = 255
        image = _unnormalise(imagenet.preprocess_for_eval(_jpeg(pixels), image_size=224))
        self.assertEqual(image.shape, (224, 224, 3))
        self.assertGreater(image[2:-2, 2:-2].min(), 240)
        # At half size the same window is resized to 112.
        image = _unnormalise(imagenet.preprocess_for_eval(_jpeg(pixels), image_size=112))
        self.assertEqual(image.shape, (112, 112, 3))
        self.assertGreater(image[2:-2, 2:-2].min(), 240)

    def test_eval_is_deterministic(self):
        for h, w in SIZES:
            encoded = _jpeg(_gradient(h, w))
            a = imagenet.preprocess_for_eval(encoded, image_size=64)
            self.assertEqual((a.shape, a.dtype), ((64, 64, 3), tf.float32))
            self.assertAllEqual(a, imagenet.preprocess_for_eval(encoded, image_size=64))


class PipelineTest(TestCase):

    def _mock(self, split="train", ctx=None, **kwargs):
        kwargs = {"batch_size": 4, "image_size": 32, "use_mock": True, "mock_num_examples": 10, **kwargs}
        return imagenet.imagenet_input(split, ctx, **kwargs)

    def test_mock_train_batches(self):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        ds = self._mock("train", ctx, batch_size=ctx.get_per_replica_batch_size(8))
        batches = list(ds.take(6))  # more than the 5 examples of this shard: it repeats
        self.assertLen(batches, 6)
        for b in batches:
            self.assertEqual(b["image"].shape, (2, 32, 32, 3))
            self.assertEqual(b["image"].dtype, tf.float32)
            self.assertEqual(b["label"].dtype, tf.int32)
            self.assertTrue(np.all((b["label"] >= 0) & (b["label"] < 1000)))

    def test_mock_eval_is_one_sharded_pass(self):
        labels = []
        for i in range(2):
            ctx = tf.distribute.InputContext(2, i, 2)
            batches = list(self._mock("validation", ctx, batch_size=2, mock_num_examples=12))
            self.assertLen(batches, 3)  # 6 examples per shard, batches of 2
            labels.append(np.concatenate([b["label"] for b in batches]))
        every = np.concatenate([b["label"] for b in self._mock("validation", batch_size=1,
                                                                mock_num_examples=12)])
        self.assertCountEqual(np.concatenate(labels), every)
        # The partial last batch is kept (the trainer pads it): 12 examples in batches of 5.
        sizes = [len(b["label"]) for b in self._mock("validation", batch_size=5, mock_num_examples=12)]
        self.assertEqual(sizes, [5, 5, 2])
        # training=False on a train split: eval preprocessing, one pass.
        self.assertEqual([len(b["label"]) for b in self._mock("train", batch_size=4, training=False)], [4, 4, 2])

    def test_deterministic_and_resumable(self):
        # A rebuilt pipeline (as in a new process) repeats the same batches.
        first = [b["image"].numpy() for b in self._mock(seed=7, deterministic=True).take(4)]
        again = [b["image"].numpy() for b in self._mock(seed=7, deterministic=True).take(4)]
        for a, b in zip(first, again, strict=True):
            self.assertAllEqual(a, b)
        other = next(iter(self._mock(seed=8, deterministic=True)))["image"]
        self.assertNotAllClose(other, first[0])
        # deterministic without a seed uses seed 0.
        self.assertAllEqual(next(iter(self._mock(deterministic=True)))["image"],
                            next(iter(self._mock(seed=0, deterministic=True)))["image"])
        # The position is an index: a pipeline rebuilt at global example 8 continues exactly.
        resumed = iter(self._mock("train", InputContext(1, 0, 1, start_example=8), seed=7, deterministic=True))
        self.assertAllEqual(next(resumed)["image"], first[2])

    def test_gin(self):
        gin.parse_config("""
            imagenet_input.use_mock = True
            imagenet_input.mock_num_examples = 8
            imagenet_input.image_size = 48
            imagenet_input.dtype = 'bfloat16'
        """)
        # As ClassificationTask calls it.
        batch = next(iter(imagenet.imagenet_input(
            split="train", ctx=tf.distribute.InputContext(1, 0, 2), batch_size=2, training=True,
            seed=1, deterministic=False)))
        self.assertEqual(batch["image"].shape, (2, 48, 48, 3))
        self.assertEqual(batch["image"].dtype, tf.bfloat16)

    def test_bad_batch_size_is_a_config_error(self):
        with self.assertRaisesRegex(ConfigError, "batch_size=0"):
            self._mock(batch_size=0)


class AvailabilityTest(TestCase):

    def test_missing_dataset_is_a_config_error(self):
        data_dir = self.get_temp_dir()
        manual = os.path.join(data_dir, "downloads", "manual")
        with self.assertRaises(ConfigError) as caught:
            imagenet.imagenet_input("train", batch_size=8, data_dir=data_dir)
        # One line (gin appends a second, "In call to configurable ...", to every error).
        message = str(caught.exception).splitlines()[0]
        for part in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", manual,
                     "imagenet_input.manual_dir", "imagenet_input.data_dir"):
            self.assertIn(part, message)

    def test_names_only_the_missing_file(self):
        manual = os.path.join(self.get_temp_dir(), "my_manual")
        os.makedirs(manual)
        open(os.path.join(manual, "ILSVRC2012_img_train.tar"), "w").close()
        with self.assertRaisesRegex(ConfigError, f"ILSVRC2012_img_val.tar is not in the manual dir {manual}"):
            imagenet.prepare(data_dir=self.get_temp_dir(), manual_dir=manual)

    def test_multi_worker_does_not_prepare(self):
        manual = os.path.join(self.get_temp_dir(), "manual")
        os.makedirs(manual)
        for name in imagenet.MANUAL_FILES:
            open(os.path.join(manual, name), "w").close()
        with self.assertRaisesRegex(ConfigError, "tfds build imagenet2012"):
            imagenet.imagenet_input("train", tf.distribute.InputContext(2, 0, 2), batch_size=8,
                                    data_dir=self.get_temp_dir(), manual_dir=manual)

    def test_metadata_needs_no_network(self):
        def refuse(*args, **kwargs):
            raise AssertionError(f"network access: {args}")
        with mock.patch.object(socket.socket, "connect", refuse):
            builder = imagenet._builder(self.get_temp_dir())
            self.assertEqual(builder.info.features["label"].num_classes, 1000)
            self.assertFalse(builder.is_prepared())
