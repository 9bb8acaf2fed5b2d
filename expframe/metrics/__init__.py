"""Sample-quality metrics for generative models: FID, Inception Score, feature networks,
and the replicated pipeline that computes them over N generated and N real images.

    from expframe import metrics
    metrics.frechet_distance(mu1, sigma1, mu2, sigma2)     # float64, SciPy sqrtm
    metrics.inception_score(probs, splits=10)              # (mean, std)

Feature networks (gin): `@inception_network` (the standard Inception graph, from a
file the user provides) and `@shapes_classifier` (trained once on first use).
"""

from expframe.metrics.feature_networks import FeatureNetwork, FrozenGraphNetwork, inception_network
from expframe.metrics.scores import frechet_distance, inception_score, statistics
from expframe.metrics.shapes_classifier import ShapesClassifier, shapes_classifier

__all__ = ["frechet_distance", "inception_score", "statistics", "FeatureNetwork", "FrozenGraphNetwork",
           "inception_network", "ShapesClassifier", "shapes_classifier"]
