"""expframe: declarative, config-driven distributed ML experiments on TensorFlow 2.

    import expframe as xf
    rep = xf.Replicator(target="cpu", num_replicas=2)
"""

from expframe import layers
from expframe.errors import ConfigError, RunError
from expframe.replicator import (Replicator, ReplicatedOptimizer, all_gather, all_reduce, broadcast,
                                 num_replicas, replica_id, split_cpu, wrap_optimizer)

__version__ = "0.1.0"
__all__ = ["Replicator", "ReplicatedOptimizer", "wrap_optimizer", "all_reduce", "broadcast",
           "all_gather", "replica_id", "num_replicas", "split_cpu", "layers", "ConfigError", "RunError"]
