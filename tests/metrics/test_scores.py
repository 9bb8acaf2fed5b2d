"""frechet_distance and inception_score against closed forms."""

import numpy as np
import pytest

from expframe import metrics


def _random_covariance(rng, dim):
    a = rng.normal(size=(dim, dim))
    return a @ a.T + 0.1 * np.eye(dim)


def test_frechet_distance_of_diagonal_gaussians_is_the_closed_form():
    rng = np.random.default_rng(0)
    for dim in (1, 5, 64):
        mu1, mu2 = rng.normal(size=dim), rng.normal(size=dim)
        d1, d2 = rng.uniform(0.1, 3.0, dim), rng.uniform(0.1, 3.0, dim)
        want = np.sum((mu1 - mu2) ** 2) + np.sum(d1 + d2 - 2.0 * np.sqrt(d1 * d2))
        got = metrics.frechet_distance(mu1, np.diag(d1), mu2, np.diag(d2))
        assert abs(got - want) <= 1e-6 * max(1.0, want), (dim, got, want)


def test_frechet_distance_is_zero_for_identical_statistics_and_scales_as_expected():
    rng = np.random.default_rng(1)
    mu, sigma = rng.normal(size=16), _random_covariance(rng, 16)
    assert abs(metrics.frechet_distance(mu, sigma, mu, sigma)) < 1e-6
    # Scaled covariance c^2 * sigma: the trace term is tr(sigma) (1 - c)^2.
    got = metrics.frechet_distance(mu, sigma, mu + 1.0, 4.0 * sigma)
    np.testing.assert_allclose(got, 16.0 + np.trace(sigma), rtol=1e-6)


def test_frechet_distance_of_singular_covariances_is_finite():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 8))  # 5 samples in 8 dims: rank-deficient covariances
    mu1, s1 = metrics.statistics(x)
    mu2, s2 = metrics.statistics(x + 0.5)
    got = metrics.frechet_distance(mu1, s1, mu2, s2)
    np.testing.assert_allclose(got, 8 * 0.25, rtol=1e-3, atol=1e-3)


def test_frechet_distance_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes"):
        metrics.frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_statistics_are_float64_mean_and_unbiased_covariance():
    x = np.random.default_rng(3).normal(size=(100, 4)).astype(np.float32)
    mu, sigma = metrics.statistics(x)
    assert mu.dtype == np.float64 and sigma.dtype == np.float64
    np.testing.assert_allclose(mu, x.astype(np.float64).mean(0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(x.astype(np.float64), rowvar=False), rtol=1e-12)


def test_inception_score_is_one_for_identical_predictions():
    probs = np.tile(np.random.default_rng(4).dirichlet(np.ones(7)), (50, 1))
    mean, std = metrics.inception_score(probs, splits=5)
    np.testing.assert_allclose([mean, std], [1.0, 0.0], atol=1e-9)


def test_inception_score_is_the_class_count_for_confident_uniform_predictions():
    for classes in (2, 10, 1008):
        probs = np.eye(classes)[np.arange(classes * 4) % classes]
        mean, std = metrics.inception_score(probs, splits=4)
        np.testing.assert_allclose([mean, std], [classes, 0.0], rtol=1e-9, atol=1e-9)


def test_inception_score_of_a_known_mixture():
    # Half the samples certain of class 0, half uniform over 2 classes:
    # p(y) = (3/4, 1/4); KL = 1/2 [log(4/3)] + 1/2 [1/2 log(2/3) + 1/2 log(2)].
    probs = np.array([[1.0, 0.0], [0.5, 0.5]] * 10)
    kl = 0.5 * np.log(4 / 3) + 0.5 * (0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25))
    np.testing.assert_allclose(metrics.inception_score(probs, splits=1)[0], np.exp(kl), rtol=1e-12)
