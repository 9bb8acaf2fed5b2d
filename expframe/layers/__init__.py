"""Keras layers that know about replicas only through expframe's collectives."""

from expframe.layers.conditional_batch_norm import ConditionalBatchNorm
from expframe.layers.spectral_norm import SNConv2D, SNDense, SNEmbedding
from expframe.layers.sync_batch_norm import SyncBatchNorm
from expframe.layers.tensor_parallel import (
    ColumnParallelDense,
    HeadParallelAttention,
    LayerNorm,
    ParallelMLP,
    PatchEmbedding,
    RowParallelDense,
)

__all__ = ["SyncBatchNorm", "ConditionalBatchNorm", "SNConv2D", "SNDense", "SNEmbedding",
           "ColumnParallelDense", "RowParallelDense", "ParallelMLP", "HeadParallelAttention", "LayerNorm",
           "PatchEmbedding"]
