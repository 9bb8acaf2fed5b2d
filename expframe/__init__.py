"""expframe: declarative, config-driven distributed ML experiments on TensorFlow 2.

    import expframe as xf
    rep = xf.Replicator(target="cpu", num_replicas=2)
"""

import os as _os

# TensorFlow's default CPU allocator returns large freed buffers to the OS, so every
# new 64 MB tensor page-faults afresh (16k faults measured); the BFC allocator
# reuses them: all-reduce of 64 MB on 2 CPU replicas went from 4.9x to 1.7x a
# memcpy (benchmarks/collectives.py). Read once, when TensorFlow starts.
_os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from expframe import layers  # noqa: E402
from expframe.errors import ConfigError, RunError
from expframe.replicator import (Replicator, ReplicatedOptimizer, all_gather, all_reduce, broadcast,
                                 num_replicas, replica_id, split_cpu, wrap_optimizer)

__version__ = "0.1.0"
__all__ = ["Replicator", "ReplicatedOptimizer", "wrap_optimizer", "all_reduce", "broadcast",
           "all_gather", "replica_id", "num_replicas", "split_cpu", "layers", "ConfigError", "RunError"]
