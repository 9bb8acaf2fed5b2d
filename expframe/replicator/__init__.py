"""The only package that touches tf.distribute: targets, collectives, optimizer, input."""

from expframe.replicator.collectives import all_gather, all_reduce, broadcast, num_replicas, replica_id
from expframe.replicator.optimizer import ReplicatedOptimizer, wrap_optimizer
from expframe.replicator.replicator import Replicator
from expframe.replicator.targets import TARGETS, reserve_inter_op_threads, split_cpu, split_only_for

__all__ = ["Replicator", "ReplicatedOptimizer", "wrap_optimizer", "all_reduce", "broadcast",
           "all_gather", "replica_id", "num_replicas", "split_cpu", "reserve_inter_op_threads",
           "split_only_for", "TARGETS"]
