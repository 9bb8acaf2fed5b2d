"""The replicated metric pipeline: features of N images on every replica, gathered in order.

Each replica runs the feature network on its share of a global batch (generated
images or real ones); one `all_gather` per batch puts the global batch, in replica
order, on every replica; the host keeps one copy. Batches are laid out by global
index (see expframe/tasks/gan_inputs.py), so the N images, and the statistics fitted
to their features, are the same on 1 or N replicas and on one host or several.

    features = ReplicatedFeatures(replicator, network)
    out = features.collect(input_fn, images_fn, num_examples=10_000, global_batch=256)
    out["features"], out["logits"], out["labels"]          # numpy, [N, ...]

then `scores.statistics`, `scores.frechet_distance`, `scores.inception_score`.
"""

import math
from typing import Callable, Dict, Tuple

import numpy as np
import tensorflow as tf

import expframe as xf
from expframe.metrics.feature_networks import FeatureNetwork
from expframe.metrics.scores import frechet_distance, inception_score, statistics


class ReplicatedFeatures:
    """Runs a FeatureNetwork over replicated batches of images (see module docstring).

    Args:
      replicator: the run's `Replicator` (synchronous targets).
      network: the feature network, built in the replicator's scope.
    """

    def __init__(self, replicator, network: FeatureNetwork):
        self.replicator = replicator
        self.network = network
        self._steps = {}

    def _step(self, images_fn):
        step = self._steps.get(images_fn)
        if step is None:
            rep = self.replicator

            @tf.autograph.experimental.do_not_convert
            def replica_fn(element):
                images, labels = images_fn(element)
                features, logits = self.network(images)
                # One gather of the global batch, in replica order, on every replica.
                return xf.all_gather({"features": features, "logits": logits,
                                      "labels": tf.cast(labels, tf.int32)}, axis=0)

            step = self._steps[images_fn] = tf.function(lambda iterator: rep.run(replica_fn, rep.next_from(iterator)))
        return step

    def collect(self, input_fn: Callable, images_fn: Callable[[Dict], Tuple[tf.Tensor, tf.Tensor]],
                num_examples: int, global_batch: int) -> Dict[str, np.ndarray]:
        """Features, logits and labels of the first `num_examples` images of `input_fn`.

        Args:
          input_fn: `fn(ctx) -> tf.data.Dataset` of per-replica elements, at least
            ceil(num_examples / global_batch) global batches.
          images_fn: replica context, element -> (images in [-1, 1], labels).
          num_examples: N.
          global_batch: examples per step over all replicas.
        """
        iterator = self.replicator.distribute(input_fn, global_batch).plain_iterator()
        step = self._step(images_fn)
        parts = []
        for _ in range(math.ceil(num_examples / global_batch)):
            out = self.replicator.local_results(step(iterator))[0]
            parts.append({k: v.numpy() for k, v in out.items()})
        return {k: np.concatenate([p[k] for p in parts])[:num_examples] for k in parts[0]}


def sample_scores(fake: Dict[str, np.ndarray], real_stats: Tuple[np.ndarray, np.ndarray], splits: int,
                  labels_match_data: bool) -> Dict[str, float]:
    """fid, inception_score (+ its std over splits) and, where the network's classes are
    the data's, the class accuracy of the samples."""
    mu, sigma = statistics(fake["features"])
    logits = fake["logits"].astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    score, spread = inception_score(probs, splits=min(splits, len(probs)))
    out = {"fid": frechet_distance(mu, sigma, *real_stats), "inception_score": score, "inception_score_std": spread}
    if labels_match_data:
        out["sample_accuracy"] = float(np.mean(np.argmax(logits, axis=1) == fake["labels"]))
    return out
