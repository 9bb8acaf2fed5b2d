"""The sample-quality scores, in float64 NumPy: Frechet distance (FID) and Inception Score.

    frechet_distance(mu1, sigma1, mu2, sigma2)
        = |mu1 - mu2|^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))

is the FID (Heusel et al. 2017) when the statistics are those of a feature network's
activations on generated and real images. The matrix square root is SciPy's
`sqrtm`, handled as in the reference TTUR code: if the product is singular (the
square root has non-finite entries) an epsilon * I is added to both covariances; a
small imaginary part from round-off is dropped, a large one is an error.

    inception_score(probs, splits) = exp(E_x KL(p(y|x) || p(y)))

(Salimans et al. 2016): the mean and standard deviation over `splits` equal parts
of the samples, as in the reference improved-GAN code.
"""

import warnings
from typing import Tuple

import numpy as np
from scipy import linalg

_SQRTM_EPS = 1e-6
_MAX_IMAGINARY = 1e-3


def statistics(features: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(mean [F], covariance [F, F]) of features [N, F] in float64 (unbiased covariance)."""
    features = np.asarray(features, np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"statistics need features [N >= 2, F], got shape {features.shape}.")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """Frechet distance between the Gaussians N(mu1, sigma1) and N(mu2, sigma2).

    Args:
      mu1, mu2: means [F].
      sigma1, sigma2: covariances [F, F] (symmetric positive semi-definite).

    Returns:
      The distance as a Python float (>= 0 up to round-off).

    Raises:
      ValueError: shapes disagree, or the square root has a large imaginary part.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != mu1.shape * 2:
        raise ValueError(f"frechet_distance: shapes mu {mu1.shape}/{mu2.shape}, sigma {sigma1.shape}/{sigma2.shape} "
                         "must be [F] and [F, F] for both.")
    diff = mu1 - mu2
    with warnings.catch_warnings():  # a singular product is handled below
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        covmean = linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        # Singular product: regularise both covariances (as the TTUR reference code does).
        offset = np.eye(sigma1.shape[0]) * _SQRTM_EPS
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=_MAX_IMAGINARY):
            raise ValueError(f"frechet_distance: the matrix square root has an imaginary component "
                             f"{np.max(np.abs(covmean.imag)):.3g}; are the covariances positive semi-definite?")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))


def inception_score(probs: np.ndarray, splits: int = 10) -> Tuple[float, float]:
    """Inception Score of class probabilities p(y|x), [N, K] (rows sum to 1).

    Args:
      probs: predicted class probabilities of N samples.
      splits: the samples are cut into this many equal parts (the last N % splits
        are dropped); the score is computed on each.

    Returns:
      (mean, standard deviation) of the score over the splits. 1 for identical
      predictions; K for confident predictions spread evenly over K classes.
    """
    probs = np.asarray(probs, np.float64)
    if probs.ndim != 2:
        raise ValueError(f"inception_score: probs must be [N, K], got shape {probs.shape}.")
    if not isinstance(splits, int) or not 1 <= splits <= probs.shape[0]:
        raise ValueError(f"inception_score: splits={splits!r} must be an integer in [1, N={probs.shape[0]}].")
    part = probs.shape[0] // splits
    scores = []
    for i in range(splits):
        p = probs[i * part:(i + 1) * part]
        marginal = p.mean(axis=0, keepdims=True)
        # KL(p(y|x) || p(y)), with 0 log 0 = 0.
        kl = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(np.where(p > 0, marginal, 1.0))), 0.0)
        scores.append(np.exp(kl.sum(axis=1).mean()))
    return float(np.mean(scores)), float(np.std(scores))
