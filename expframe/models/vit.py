"""A small Vision Transformer (Dosovitskiy et al., arXiv 2010.11929) of tensor-parallel layers.

It knows nothing of hardware: its layers take their layouts from the current mesh
(build it inside `Replicator.scope()` of a `Replicator(target='mesh')`). With the
mesh's `model` axis of size m, each block's MLP and attention heads are split m ways;
with m = 1 it is an ordinary (data-parallel) ViT.
"""

from typing import List, Optional, Sequence

import gin
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.layers import tensor_parallel as tp


class EncoderBlock(tf.Module):
    """Pre-norm Transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, num_heads: int, mlp_dim: int, seed: int, name: Optional[str] = None):
        super().__init__(name=name)
        self.norm1 = tp.LayerNorm(width, name="norm1")
        self.attention = tp.HeadParallelAttention(width, num_heads, seed, binding="ViT.num_heads",
                                                  name="attention")
        self.norm2 = tp.LayerNorm(width, name="norm2")
        self.mlp = tp.ParallelMLP(width, mlp_dim, seed + 10, binding="ViT.mlp_dim", name="mlp")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


@gin.configurable
class ViT(tf.Module):
    """Patch embedding, `depth` encoder blocks, layer norm, a linear head on the class token.

    Example:
      with replicator.scope():
          model = ViT(num_classes=10, image_size=32)
      logits = model(images)      # images split over the mesh's `batch` axis

    Args:
      num_classes: outputs of the head.
      image_size: input height = width (pixels).
      channels: input channels.
      patch_size: side of the square patches (pixels); divides image_size.
      width: token width.
      depth: encoder blocks.
      num_heads: attention heads per block; divides width and the mesh's `model` axis size.
      mlp_dim: hidden units of each block's MLP; divides by the `model` axis size.
      seed: initializer seed (the same weights on every mesh shape).
      stem_widths: channels of an optional convolutional stem (`ConvStem`, Xiao et al.
        2021): n 3x3 stride-2 convolutions before a patch embedding of patch_size / 2^n,
        which 2^n must divide. Empty (the default): the plain ViT's linear patch embedding.
    """

    def __init__(self, num_classes: int = gin.REQUIRED, image_size: int = gin.REQUIRED, channels: int = 3,
                 patch_size: int = 8, width: int = 64, depth: int = 2, num_heads: int = 4,
                 mlp_dim: int = 128, seed: int = 0, stem_widths: Sequence[int] = (), name: str = "vit"):
        super().__init__(name=name)
        self.num_classes = num_classes
        if image_size % patch_size:
            raise ConfigError(f"ViT.patch_size={patch_size} does not divide ViT.image_size={image_size}.")
        stride = 2 ** len(stem_widths)
        if patch_size % stride:
            raise ConfigError(f"ViT.stem_widths={tuple(stem_widths)} has {len(stem_widths)} stride-2 convolutions: "
                              f"{stride} must divide ViT.patch_size={patch_size}; use fewer or a larger patch.")
        self.stem = tp.ConvStem(channels, stem_widths, seed + 50, name="stem") if stem_widths else None
        self.embed = tp.PatchEmbedding(image_size // stride, patch_size // stride,
                                       self.stem.channels if self.stem else channels, width, seed, name="embed")
        self.blocks: List[EncoderBlock] = [EncoderBlock(width, num_heads, mlp_dim, seed + 100 * (i + 1),
                                                        name=f"block{i}") for i in range(depth)]
        self.norm = tp.LayerNorm(width, name="norm")
        self.head_kernel = tp.replicated_variable(tp.truncated_normal(seed + 7, 0.02), [width, num_classes],
                                                  name="head_kernel")
        self.head_bias = tp.replicated_variable(tf.zeros, [num_classes], name="head_bias")

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        """images: [batch, H, W, C] split over `batch` -> logits [batch, num_classes]."""
        x = tf.cast(images, tf.float32)
        x = self.embed(self.stem(x) if self.stem else x)
        for block in self.blocks:
            x = block(x)
        return tf.matmul(self.norm(x)[:, 0], self.head_kernel) + self.head_bias
