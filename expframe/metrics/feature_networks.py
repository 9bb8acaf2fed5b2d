"""Feature networks for FID and Inception Score: what the metric pipeline runs on images.

A `FeatureNetwork` maps images in [-1, 1] (the generator's range) to
(features [B, F], logits [B, K]) in float32: FID compares Gaussians fitted to the
features, the Inception Score uses softmax(logits).

`inception_network(graph_path)`: the standard Inception graph behind published FID
and IS numbers, `classify_image_graph_def.pb` from TensorFlow's
inception-2015-12-05.tgz (the graph used by the TTUR FID code and the improved-GAN
Inception Score code). Nothing is downloaded: the user puts the file somewhere and
binds `inception_network.graph_path`. It is loaded the TF2 way, with
`tf.compat.v1.wrap_function` around `tf.graph_util.import_graph_def`, feeding images
into the graph's `ExpandDims:0` (float RGB in [0, 255], any size: the graph resizes
to 299x299 and normalises itself) and reading
  * features: `pool_3:0`, [B, 1, 1, 2048] -> [B, 2048];
  * logits: pool_3 times the weights of `softmax/logits/MatMul` (1008 classes), without
    the bias, exactly as the improved-GAN reference code computes its softmax.
Any frozen GraphDef with these tensor names loads the same way (the tests build a
small stand-in).

`shapes_classifier` (expframe/metrics/shapes_classifier.py) is the feature network
for the offline `shapes` dataset.
"""

import os
from typing import Optional, Tuple

import gin
import tensorflow as tf

from expframe.errors import ConfigError

INPUT_TENSOR = "ExpandDims:0"
FEATURES_TENSOR = "pool_3:0"
LOGITS_MATMUL = "softmax/logits/MatMul"


class FeatureNetwork:
    """Images in [-1, 1] -> (features, logits). Subclasses implement `__call__`.

    Attributes:
      name: for logs.
      num_classes: K, the logits' width.
      labels_match_data: True if logit k is the dataset's class k (then the class
        accuracy of generated samples can be judged by this network).
    """

    name = "features"
    num_classes = 0
    labels_match_data = False

    def build(self) -> None:
        """Creates variables; called inside `Replicator.scope()`. Default: none."""

    def __call__(self, images: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        raise NotImplementedError


class FrozenGraphNetwork(FeatureNetwork):
    """A frozen Inception-style GraphDef (see module docstring); holds no variables."""

    def __init__(self, path: str, binding: str = "inception_network.graph_path"):
        if not path:
            raise ConfigError(f"{binding} is not set: bind it to the path of classify_image_graph_def.pb "
                              "(from inception-2015-12-05.tgz; see docs/sngan.md).")
        if not tf.io.gfile.exists(path):
            raise ConfigError(f"{binding}={path!r}: no such file; put classify_image_graph_def.pb (from "
                              "inception-2015-12-05.tgz) there, or bind the path where it is (see docs/sngan.md).")
        graph_def = tf.compat.v1.GraphDef()
        try:
            with tf.io.gfile.GFile(path, "rb") as f:
                graph_def.ParseFromString(f.read())
        except Exception as e:  # pylint: disable=broad-except
            raise ConfigError(f"{binding}={path!r}: not a frozen GraphDef ({type(e).__name__}: {e}).") from None
        names = {node.name for node in graph_def.node}
        missing = [t for t in (INPUT_TENSOR, FEATURES_TENSOR, LOGITS_MATMUL + ":0") if t.split(":")[0] not in names]
        if missing:
            raise ConfigError(f"{binding}={path!r}: the graph has no {', '.join(missing)}; expected the Inception "
                              "graph classify_image_graph_def.pb.")

        def imported(images):
            features, matmul = tf.graph_util.import_graph_def(
                graph_def, input_map={INPUT_TENSOR: images},
                return_elements=[FEATURES_TENSOR, LOGITS_MATMUL + ":0"], name="inception")
            features = tf.reshape(features, [-1, features.shape[-1]])
            weights = matmul.op.inputs[1]
            return features, tf.matmul(features, weights)

        wrapped = tf.compat.v1.wrap_function(imported, [tf.TensorSpec([None, None, None, 3], tf.float32)])
        # Keep only what the outputs need (the graph also holds JPEG decoding from a placeholder).
        self._fn = wrapped.prune(wrapped.inputs[0], wrapped.outputs)
        self.name = os.path.basename(path)
        self.num_classes = int(wrapped.outputs[1].shape[-1])

    def __call__(self, images):
        pixels = (tf.cast(images, tf.float32) + 1.0) * 127.5  # [-1, 1] -> [0, 255]
        features, logits = self._fn(pixels)
        return tf.cast(features, tf.float32), tf.cast(logits, tf.float32)


@gin.configurable
def inception_network(graph_path: Optional[str] = None) -> FeatureNetwork:
    """The standard Inception graph for ImageNet FID / IS.

    Args:
      graph_path: path of `classify_image_graph_def.pb` (from
        inception-2015-12-05.tgz). A missing file is a configuration error.
    """
    return FrozenGraphNetwork(graph_path)
