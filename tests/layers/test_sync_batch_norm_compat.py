"""SyncBatchNorm after issue 59 is the same layer to everything outside it: a checkpoint
written by the layer before (gathered moments) restores unchanged, on 4 replicas and on
1, and Keras' own BatchNormalization tests pass with the class swapped in."""

import json
import os
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.layers.normalization import batch_normalization_test as keras_tests

import expframe as xf
from tests import support

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "before_issue_59")
sys.path.insert(0, HERE)
import make as before  # noqa: E402  (the model and probe the checkpoint was written with)

sys.path.remove(HERE)


@pytest.mark.parametrize("replicas", [4, 1])
def test_checkpoint_from_before_restores_unchanged(replicas):
    with open(os.path.join(HERE, "values.json"), encoding="utf-8") as f:
        stored = json.load(f)
    rep = support.replicator("cpu", replicas)
    with rep.scope():
        model = before.build(xf.layers.SyncBatchNorm)
    status = tf.train.Checkpoint(model=model).read(os.path.join(HERE, "ckpt-1"))
    status.assert_consumed()  # every saved value found its variable, and every variable a value
    assert sorted(v.path for v in model.weights) == sorted(stored["variables"])
    for v in model.weights:
        for local in rep.local_results(v.value):
            np.testing.assert_array_equal(np.asarray(local), np.asarray(stored["variables"][v.path], np.float32))
    with rep.scope():
        output = model(before.probe(), training=False)
    np.testing.assert_allclose(output, stored["output"], rtol=1e-6, atol=1e-6)
    # and it trains on from there
    step = tf.function(lambda v: rep.run(lambda x: model(x, training=True), v))
    out = step(support.per_replica(rep, lambda r: before.probe()[:4 // replicas] + r))
    assert all(np.isfinite(np.asarray(o)).all() for o in rep.local_results(out))


class _SyncLayers(types.ModuleType):
    """keras.src.layers with BatchNormalization swapped for SyncBatchNorm."""

    def __getattr__(self, name):
        return xf.layers.SyncBatchNorm if name == "BatchNormalization" else getattr(keras.src.layers, name)


class KerasBatchNormalizationSuiteOnSyncBatchNorm(keras_tests.BatchNormalizationTest):
    """Keras' own tests (keras/src/layers/normalization/batch_normalization_test.py of the
    installed Keras) on one replica, with every `layers.BatchNormalization` a SyncBatchNorm."""

    def setUp(self):
        super().setUp()
        self._layers = keras_tests.layers
        keras_tests.layers = _SyncLayers("layers")

    def tearDown(self):
        keras_tests.layers = self._layers
        super().tearDown()

    def test_the_swap_took_effect(self):
        self.assertIs(keras_tests.layers.BatchNormalization, xf.layers.SyncBatchNorm)
        self.assertIsInstance(keras_tests.layers.BatchNormalization(), xf.layers.SyncBatchNorm)
