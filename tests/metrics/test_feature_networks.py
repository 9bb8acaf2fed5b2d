"""The Inception-graph loader on a small stand-in frozen GraphDef with the real tensor
names, and the replicated metric pipeline (same features, in order, on N replicas)."""

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe import metrics
from expframe.metrics.pipeline import ReplicatedFeatures
from tests import support

FEATURES, CLASSES, SIDE = 6, 9, 8


def write_standin_graph(path, seed=0):
    """A frozen GraphDef laid out like classify_image_graph_def.pb: JPEG bytes ->
    DecodeJpeg -> Cast -> ExpandDims (the input we feed) -> ResizeBilinear -> Sub/Mul
    -> conv -> pool_3 [1, 1, 1, F] -> pool_3/_reshape [1, F] -> softmax/logits/MatMul
    (+ bias, which the IS reference code ignores) -> softmax. Returns its weights."""
    rng = np.random.default_rng(seed)
    kernel = rng.normal(size=(3, 3, 3, FEATURES)).astype(np.float32) * 0.3
    weights = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
    bias = rng.normal(size=(CLASSES,)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        contents = tf.compat.v1.placeholder(tf.string, [], name="DecodeJpeg/contents")
        decoded = tf.io.decode_jpeg(contents, channels=3, name="DecodeJpeg")
        expanded = tf.expand_dims(tf.cast(decoded, tf.float32, name="Cast"), 0, name="ExpandDims")
        resized = tf.compat.v1.image.resize_bilinear(expanded, [SIDE, SIDE], name="ResizeBilinear")
        x = tf.multiply(tf.subtract(resized, 128.0, name="Sub"), 1.0 / 128.0, name="Mul")
        h = tf.nn.relu(tf.nn.conv2d(x, tf.constant(kernel), 1, "SAME"))
        pool = tf.nn.avg_pool2d(h, SIDE, SIDE, "VALID", name="pool_3")
        flat = tf.reshape(pool, [1, FEATURES], name="pool_3/_reshape")
        logits = tf.matmul(flat, tf.constant(weights, name="softmax/weights"), name="softmax/logits/MatMul")
        tf.nn.softmax(tf.nn.bias_add(logits, tf.constant(bias), name="softmax/logits"), name="softmax")
    with open(path, "wb") as f:
        f.write(graph.as_graph_def().SerializeToString())
    return kernel, weights


def reference(images, kernel, weights):
    """The stand-in graph's features and bias-free logits, computed directly."""
    pixels = (tf.constant(images) + 1.0) * 127.5
    x = (tf.compat.v1.image.resize_bilinear(pixels, [SIDE, SIDE]) - 128.0) / 128.0
    features = tf.reduce_mean(tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "SAME")), axis=[1, 2]).numpy()
    return features, features @ weights


def _images(n, size=16, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, size=(n, size, size, 3)).astype(np.float32)


class FeatureNetworkTest(support.TestCase):

    def test_loads_a_frozen_graph_and_runs_batches(self):
        path = self.get_temp_dir() + "/graph.pb"
        kernel, weights = write_standin_graph(path)
        net = metrics.inception_network(graph_path=path)
        self.assertEqual(net.num_classes, CLASSES)
        images = _images(5)
        features, logits = net(tf.constant(images))
        want_features, want_logits = reference(images, kernel, weights)
        self.assertEqual(features.shape, (5, FEATURES))
        self.assertAllClose(features, want_features, rtol=1e-4, atol=1e-5)
        self.assertAllClose(logits, want_logits, rtol=1e-4, atol=1e-5)

    def test_missing_or_bad_file_is_a_config_error_naming_the_binding(self):
        with pytest.raises(xf.ConfigError, match=r"inception_network.graph_path='/nonexistent/g.pb': no such file"):
            metrics.inception_network(graph_path="/nonexistent/g.pb")
        with pytest.raises(xf.ConfigError, match=r"inception_network.graph_path is not set"):
            metrics.inception_network()
        bad = self.get_temp_dir() + "/bad.pb"
        with open(bad, "wb") as f:
            f.write(tf.Graph().as_graph_def().SerializeToString())  # a valid but empty graph
        with pytest.raises(xf.ConfigError, match="the graph has no ExpandDims:0"):
            metrics.inception_network(graph_path=bad)

    @parameterized.named_parameters(*support.named_replicators())
    def test_replicated_features_are_gathered_in_global_order(self, target, n):
        path = self.get_temp_dir() + "/graph.pb"
        kernel, weights = write_standin_graph(path)
        rep = support.replicator(target, n)
        net = metrics.inception_network(graph_path=path)
        images, labels = _images(20), np.arange(20, dtype=np.int32)
        global_batch = 8  # 20 images: 3 global batches, the last one cut

        def input_fn(ctx):
            b = ctx.get_per_replica_batch_size(global_batch)
            ds = tf.data.Dataset.from_tensor_slices({"image": np.concatenate([images, images[:4]]),
                                                     "label": np.concatenate([labels, labels[:4]])})
            return ds.batch(b).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

        out = ReplicatedFeatures(rep, net).collect(input_fn, lambda e: (e["image"], e["label"]), 20, global_batch)
        np.testing.assert_array_equal(out["labels"], labels)
        want_features, want_logits = reference(images, kernel, weights)
        np.testing.assert_allclose(out["features"], want_features, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["logits"], want_logits, rtol=1e-4, atol=1e-5)
