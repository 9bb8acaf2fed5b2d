"""expframe: declarative, config-driven distributed ML experiments on TensorFlow 2.

    import expframe as xf
    rep = xf.Replicator(target="cpu", num_replicas=2)

The public names below load on first use, so that `import expframe` (and
`python -m expframe.launch`, which imports this package first) does not start
TensorFlow.
"""

import importlib
import os as _os

# TensorFlow's default CPU allocator returns large freed buffers to the OS, so every
# new 64 MB tensor page-faults afresh (16k faults measured); the BFC allocator
# reuses them: all-reduce of 64 MB on 2 CPU replicas went from 4.9x to 1.7x a
# memcpy (benchmarks/collectives.py). Read once, when TensorFlow starts.
_os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

__version__ = "0.1.0"

_PUBLIC = {
    "Replicator": "expframe.replicator", "ReplicatedOptimizer": "expframe.replicator",
    "wrap_optimizer": "expframe.replicator", "all_reduce": "expframe.replicator",
    "broadcast": "expframe.replicator", "all_gather": "expframe.replicator",
    "replica_id": "expframe.replicator", "num_replicas": "expframe.replicator",
    "split_cpu": "expframe.replicator", "ConfigError": "expframe.errors", "RunError": "expframe.errors",
}
__all__ = sorted(_PUBLIC) + ["layers"]


def __getattr__(name):
    if name == "layers":
        return importlib.import_module("expframe.layers")
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'expframe' has no attribute {name!r}")
