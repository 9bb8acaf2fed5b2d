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
