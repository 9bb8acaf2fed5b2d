"""Shared test helpers: the named list of replicator settings, a gin-clean base class."""

import gin
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf

# Every distribution test runs over these (Sonnet's named_replicators()).
REPLICATOR_SETTINGS = (("cpu_1", "cpu", 1), ("cpu_2", "cpu", 2), ("cpu_4", "cpu", 4))


def named_replicators(min_replicas: int = 1):
    """Parameters for `parameterized.named_parameters`: (name, target, num_replicas)."""
    return [s for s in REPLICATOR_SETTINGS if s[2] >= min_replicas]


@pytest.fixture(autouse=True)
def clean_gin():
    """Clears gin before and after each test of a pytest module that imports it."""
    gin.clear_config()
    yield
    gin.clear_config()


class TestCase(tf.test.TestCase, parameterized.TestCase):
    """Clears gin between tests; helpers for per-replica checks."""

    def setUp(self):
        super().setUp()
        gin.clear_config()

    def tearDown(self):
        gin.clear_config()
        super().tearDown()

    def assertSameValuePerReplica(self, replicator, value, atol=0.0):
        """Every local replica holds the same value (exactly, by default)."""
        values = [np.asarray(v) for v in replicator.local_results(value)]
        for v in values[1:]:
            np.testing.assert_allclose(v, values[0], atol=atol, rtol=0)

    def per_replica(self, replicator, fn):
        return per_replica(replicator, fn)


def per_replica(replicator, fn):
    """Per-replica values from fn(replica_index) (numpy or tensors)."""
    return replicator.strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.convert_to_tensor(fn(ctx.replica_id_in_sync_group)))


def replicator(target: str, num_replicas: int) -> xf.Replicator:
    return xf.Replicator(target=target, num_replicas=num_replicas)
