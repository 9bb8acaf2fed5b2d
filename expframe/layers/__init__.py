"""Keras layers that know about replicas only through expframe's collectives."""

from expframe.layers.sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
