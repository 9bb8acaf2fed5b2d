"""The index-based train order of shapes_input and imagenet_input (expframe/data/order.py)."""

import numpy as np

from expframe.data import imagenet, inputs
from expframe.replicator.inputs import InputContext
from tests.support import TestCase


def _shapes(data_dir, ctx, batch_size, count):
    ds = inputs.shapes_input("train", ctx, batch_size, training=True, seed=3, data_dir=str(data_dir),
                             num_train=512, num_test=64)
    return list(ds.take(count).as_numpy_iterator())


def test_shapes_order_is_global_and_resumes_by_index(data_dir):
    # One pipeline, global batch 16: 40 steps cross into the second epoch of 512.
    reference = _shapes(data_dir, InputContext(1, 0, 1), 16, 40)
    ids = np.concatenate([b["id"] for b in reference])
    assert sorted(ids[:512]) == list(range(512))  # every example once per epoch
    assert len(set(ids[512:])) == 128
    assert list(ids[:128]) != list(ids[512:640])  # a new order in the next epoch
    # Two pipelines (workers) of 4 replicas in all, per-replica batch 4: pipeline w
    # takes positions w, w + 2, ...; its batches 2k, 2k + 1 feed its 2 local replicas.
    for w in range(2):
        share = _shapes(data_dir, InputContext(2, w, 4), 4, 20)
        np.testing.assert_array_equal(np.concatenate([b["id"] for b in share]), ids[w::2][:80])
    # Resumed at global example 160 (10 steps of 16), on 2 replicas of one worker.
    resumed = _shapes(data_dir, InputContext(1, 0, 2, start_example=160), 8, 2)
    np.testing.assert_array_equal(resumed[0]["id"], ids[160:168])
    np.testing.assert_array_equal(resumed[1]["image"], reference[10]["image"][8:])
    np.testing.assert_array_equal(resumed[1]["label"], reference[10]["label"][8:])


def _d4(image):
    """The 8 symmetries of the square applied to one HxWxC image."""
    turns = [np.rot90(image, k) for k in range(4)]
    return turns + [np.flip(t, 0) for t in turns]


def test_shapes_augment_is_a_symmetry_of_the_square_drawn_by_position(data_dir):
    def read(ctx, batch_size, count, augment):
        ds = inputs.shapes_input("train", ctx, batch_size, training=True, seed=3, data_dir=str(data_dir),
                                 num_train=512, num_test=64, augment=augment, standardize=False)
        return list(ds.take(count).as_numpy_iterator())

    plain, turned = read(InputContext(1, 0, 1), 16, 4, False), read(InputContext(1, 0, 1), 16, 4, True)
    seen = set()
    for a, b in zip(plain, turned, strict=True):
        np.testing.assert_array_equal(a["id"], b["id"])
        np.testing.assert_array_equal(a["label"], b["label"])
        for x, y in zip(a["image"], b["image"], strict=True):
            matches = [k for k, t in enumerate(_d4(x)) if np.array_equal(t, y)]
            assert matches, "an augmented image is no symmetry of its original"
            seen.add(matches[0])
    assert len(seen) >= 6, seen  # 64 draws of 8 symmetries: not all the identity
    # The draw follows the example's position: the same on 2 pipelines and when resumed.
    for w in range(2):
        share = read(InputContext(2, w, 4), 4, 8, True)
        np.testing.assert_array_equal(np.concatenate([b["image"] for b in share]),
                                      np.concatenate([b["image"] for b in turned])[w::2])
    resumed = read(InputContext(1, 0, 1, start_example=32), 16, 1, True)
    np.testing.assert_array_equal(resumed[0]["image"], turned[2]["image"])


class ImagenetOrderTest(TestCase):

    def _mock(self, ctx, batch_size, count, **kwargs):
        ds = imagenet.imagenet_input("train", ctx, batch_size=batch_size, image_size=32, use_mock=True,
                                     mock_num_examples=10, seed=7, **kwargs)
        return list(ds.take(count).as_numpy_iterator())

    def test_order_and_augmentation_depend_only_on_the_position(self):
        reference = self._mock(InputContext(1, 0, 1), 4, 5)  # 20 positions: 2 epochs of 10
        labels = np.concatenate([b["label"] for b in reference])
        images = np.concatenate([b["image"] for b in reference])
        resumed = self._mock(InputContext(1, 0, 1, start_example=8), 4, 2)
        self.assertAllEqual(np.concatenate([b["image"] for b in resumed]), images[8:16])
        second = self._mock(InputContext(2, 1, 2), 2, 2)  # pipeline 1 of 2: positions 1, 3, 5, 7
        self.assertAllEqual(np.concatenate([b["image"] for b in second]), images[1:8:2])
        self.assertAllEqual(np.concatenate([b["label"] for b in second]), labels[1:8:2])
        self.assertNotAllClose(images[0], images[10])  # the same example differs in epoch 2 ...
        again = self._mock(InputContext(1, 0, 1), 4, 1)
        self.assertAllEqual(again[0]["image"], reference[0]["image"])  # ... but not on a rebuild
