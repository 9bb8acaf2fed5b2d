"""Image classification of a mesh model (DTensor variables) with a mesh optimizer.

`ClassificationTask` with two differences: the model is a `tf.Module` of
tensor-parallel layers (e.g. `@ViT`), built inside `Replicator.scope()` of a
`Replicator(target='mesh')`, and the optimizer is `@MeshAdam` (its slots laid out
like the variables) instead of a wrapped Keras optimizer. Losses and metrics use
plain TensorFlow ops, which the SPMD pass partitions.

Export (`serving`) saves an unsharded copy: `HostViT` computes the ViT's logits on
plain variables that hold its DTensor values gathered to the host, so the SavedModel
loads anywhere, without a mesh.
"""

import types
from typing import Any, Dict

import gin
import tensorflow as tf

import expframe as xf
from expframe import schedules
from expframe.data import raw_images
from expframe.models.vit import ViT
from expframe.replicator import mesh
from expframe.tasks.classification import ClassificationTask
from expframe.tasks.image_serving import classifier_signatures


def _host_copy(item: Any) -> Any:
    """A module's attribute tree with each DTensor variable replaced by a plain, non-trainable
    copy of its whole value (modules become namespaces; lists stay lists)."""
    if isinstance(item, tf.Variable):
        return tf.Variable(mesh.to_host(item), trainable=False, name=item.name.split(":")[0])
    if isinstance(item, tf.Module):
        return types.SimpleNamespace(**{k: _host_copy(v) for k, v in vars(item).items() if not k.startswith("_")})
    if isinstance(item, (list, tuple)):
        return [_host_copy(v) for v in item]
    return item


def _layer_norm(norm, x: tf.Tensor) -> tf.Tensor:
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + norm.epsilon) * norm.scale + norm.offset


def _attention(a, x: tf.Tensor) -> tf.Tensor:
    q = tf.einsum("btd,dhk->bthk", x, a.query) + a.query_bias
    k = tf.einsum("btd,dhk->bthk", x, a.key)
    v = tf.einsum("btd,dhk->bthk", x, a.value) + a.value_bias
    logits = tf.einsum("bthk,bshk->bhts", q, k) * (a.head_dim ** -0.5)
    mixed = tf.einsum("bhts,bshk->bthk", tf.nn.softmax(logits, axis=-1), v)
    return tf.einsum("bthk,hkd->btd", mixed, a.out) + a.out_bias


def _mlp(m, x: tf.Tensor) -> tf.Tensor:
    hidden = tf.nn.gelu(tf.einsum("btd,du->btu", x, m.up.kernel) + m.up.bias)
    return tf.einsum("btu,ud->btd", hidden, m.down.kernel) + m.down.bias


class HostViT:
    """`ViT`'s math (expframe/models/vit.py, expframe/layers/tensor_parallel.py) on plain
    variables: the same logits for any batch size, on one device, without a mesh.

    Args:
      vit: a built ViT; its values are copied now (later training does not reach the copy).
    """

    def __init__(self, vit: ViT):
        self.vit = _host_copy(vit)
        embed, stem = self.vit.embed, self.vit.stem
        side = round(embed.num_patches ** 0.5) * embed.patch_size * (2 ** len(stem.kernels) if stem else 1)
        channels = stem.kernels[0].shape[2] if stem else embed.kernel.shape[0] // embed.patch_size ** 2
        self.image_shape = (side, side, int(channels))  # ViT's input (image_size, image_size, channels)

    def _embed(self, x: tf.Tensor) -> tf.Tensor:
        e, p = self.vit.embed, self.vit.embed.patch_size
        batch, (height, width, channels) = tf.shape(x)[0], x.shape[1:]
        patches = tf.reshape(x, [batch, height // p, p, width // p, p, channels])
        patches = tf.reshape(tf.transpose(patches, [0, 1, 3, 2, 4, 5]), [batch, e.num_patches, p * p * channels])
        tokens = tf.einsum("bpf,fd->bpd", patches, e.kernel) + e.bias
        return tf.concat([tf.tile(e.cls, [batch, 1, 1]), tokens], axis=1) + e.positions

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        """images: float32 [batch, H, W, C] -> logits [batch, num_classes]."""
        x, stem = tf.cast(images, tf.float32), self.vit.stem
        for kernel, norm in zip(stem.kernels, stem.norms, strict=True) if stem else ():
            x = tf.nn.relu(_layer_norm(norm, tf.nn.conv2d(x, kernel, strides=2, padding="SAME")))
        x = self._embed(x)
        for block in self.vit.blocks:
            x = x + _attention(block.attention, _layer_norm(block.norm1, x))
            x = x + _mlp(block.mlp, _layer_norm(block.norm2, x))
        return tf.matmul(_layer_norm(self.vit.norm, x)[:, 0], self.vit.head_kernel) + self.vit.head_bias


@gin.configurable
class MeshClassificationTask(ClassificationTask):
    """Trains a mesh `model` (outputs logits, has `num_classes`) with a mesh `optimizer`.

    Args: as `ClassificationTask`; `optimizer` builds a `MeshAdam`.
    """

    def setup(self, replicator, global_batch_size: int, seed: int, deterministic: bool) -> None:
        if replicator.mesh_target is None:
            raise xf.ConfigError(
                f"MeshClassificationTask needs Replicator.target='mesh' (the target is "
                f"{replicator.target!r}); set Replicator.target and Replicator.mesh_shape.")
        super().setup(replicator, global_batch_size, seed, deterministic)

    def build(self) -> None:
        self.model = self._model_fn()
        self.num_classes = int(self.model.num_classes)
        with schedules.training_run(self.examples_per_step, self.train_examples):
            self.optimizer = self._optimizer_fn()
        self.optimizer.build(self.model.trainable_variables)
        self._decayed = [v for v in self.model.trainable_variables if len(v.shape) >= 2]

    def serving(self) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
        """As `ClassificationTask.serving` (raw-image signatures included), computed by a
        `HostViT` copy of the model (plain variables: the SavedModel needs no mesh)."""
        if not isinstance(self.model, ViT):
            raise xf.ConfigError(f"MeshClassificationTask exports ViT models only (the model is "
                                 f"{type(self.model).__name__}): its serving copy is HostViT.")
        host = HostViT(self.model)
        return classifier_signatures(host, host.image_shape, self.num_classes, raw_images.of(self._dataset_fn))

    def keras_model(self) -> None:
        """None: the model's variables are DTensors laid out on the mesh, and its serving
        copy (`HostViT`) is not a Keras model."""
        return None

    def _cross_entropy(self, labels, logits):
        onehot = tf.one_hot(tf.cast(labels, tf.int32), self.num_classes, dtype=logits.dtype)
        if self.label_smoothing:
            onehot = onehot * (1 - self.label_smoothing) + self.label_smoothing / self.num_classes
        return tf.nn.softmax_cross_entropy_with_logits(onehot, logits)

    def train_step(self, batch) -> Dict[str, tf.Tensor]:
        images, labels = batch["image"], tf.cast(batch["label"], tf.int32)
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            logits = self.model(images)
            cross_entropy = tf.reduce_mean(self._cross_entropy(labels, logits))
            loss = cross_entropy
            if self.weight_decay:
                loss += self.weight_decay * tf.add_n([tf.nn.l2_loss(v) for v in self._decayed])
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
        return {"loss": loss, "cross_entropy": cross_entropy, "accuracy": tf.reduce_mean(correct)}

    def eval_step(self, batch) -> Dict[str, tf.Tensor]:
        images, labels = batch["image"], tf.cast(batch["label"], tf.int32)
        logits = self.model(images)
        mask = tf.cast(batch["mask"], tf.float32) if "mask" in batch else tf.ones_like(labels, tf.float32)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
        return {"count": tf.reduce_sum(mask), "loss": tf.reduce_sum(mask * self._cross_entropy(labels, logits)),
                "top1": tf.reduce_sum(mask * correct)}
