"""The shapes classifier: trained once on first use, cached beside the dataset, loaded
afterwards; training draws nothing from the global random state."""

import json
import os

import keras
import numpy as np
import tensorflow as tf

from expframe import metrics
from tests import support

SMALL = dict(num_train=512, num_test=64, train_steps=20, batch_size=32)


class ShapesClassifierTest(support.TestCase):

    def test_trains_once_caches_and_loads(self):
        data_dir = self.get_temp_dir()
        lines = []
        net = metrics.shapes_classifier(data_dir=data_dir, **SMALL)
        self.assertFalse(net.cached)
        keras.utils.set_random_seed(0)
        net.prepare(log=lines.append)
        after_training = tf.random.uniform([3]).numpy()
        keras.utils.set_random_seed(0)
        self.assertAllEqual(tf.random.uniform([3]).numpy(), after_training)  # global RNG untouched
        self.assertTrue(any("training the shapes classifier" in line for line in lines))
        self.assertTrue(net.cached)
        self.assertTrue(net.weights_path.startswith(os.path.join(data_dir, "shapes_classifier", "32x32_train512")))
        with open(os.path.join(net.directory, "info.json"), encoding="utf-8") as f:
            info = json.load(f)
        self.assertEqual(info["train_steps"], 20)
        self.assertBetween(info["test_accuracy"], 0.0, 1.0)
        self.assertEqual([n for n in os.listdir(net.directory) if n.startswith(".tmp")], [])  # nothing torn

        again = metrics.shapes_classifier(data_dir=data_dir, **SMALL)
        self.assertTrue(again.cached)
        lines.clear()
        again.prepare(log=lines.append)
        self.assertEqual(lines, [])  # loaded, not trained
        for a, b in zip(net._weights, again._weights, strict=True):  # pylint: disable=protected-access
            np.testing.assert_array_equal(a, b)
        # Other settings are another classifier.
        self.assertFalse(metrics.shapes_classifier(data_dir=data_dir, **dict(SMALL, train_steps=21)).cached)

        # Replicated: the same features on every replica.
        rep = support.replicator("cpu", 2)
        with rep.scope():
            again.build()
        images = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype(np.float32)
        out = tf.function(lambda x: rep.run(again, x))(support.per_replica(rep, lambda r: images))
        features = [np.asarray(t) for t in rep.local_results(out[0])]
        self.assertEqual(features[0].shape, (4, 128))
        np.testing.assert_allclose(features[1], features[0], rtol=1e-6)
        self.assertEqual(rep.local_results(out[1])[0].shape, (4, 10))
