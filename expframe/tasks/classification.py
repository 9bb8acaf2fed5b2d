"""Generic image classification: softmax cross-entropy, label smoothing, weight decay, the
model's regularisation losses, top-k."""

from typing import Any, Callable, Dict, Optional

import gin
import keras
import tensorflow as tf

import expframe as xf
from expframe import schedules
from expframe.data import raw_images
from expframe.tasks import named_evals
from expframe.tasks.base import Task, model_losses
from expframe.tasks.image_serving import class_names, classifier_signatures, labels_asset


@gin.configurable
class ClassificationTask(Task):
    """Trains `model` on `dataset` with a replica-averaged optimizer.

    Args:
      model: builds the Keras model (e.g. `@resnet`); takes no arguments, its own
        configurable supplies depth, classes, norm. Outputs float32 logits.
      dataset: `fn(split, ctx, batch_size, training, seed, deterministic)` returning a
        tf.data.Dataset of {"image", "label"} batches of `batch_size` for this
        input pipeline (e.g. `@shapes_input`, `@imagenet_input`).
      optimizer: builds the Keras optimizer (e.g. `@keras.optimizers.SGD`), called
        inside the replicator's scope and wrapped with `wrap_optimizer`.
      label_smoothing: in [0, 1).
      weight_decay: L2 coefficient on kernels (rank >= 2); not on biases or norms.
        The model's own `losses` (e.g. `kernel_regularizer=...`) are added as well,
        whether or not this is set; the train metrics show each term: `cross_entropy`,
        `reg_loss` (the model's losses, when it has some), `weight_decay_loss` (when
        this is set), and `loss`, their sum.
      train_split, eval_split: dataset splits.
      evaluations: named evaluations of other data besides the run's own (on
        eval_split), each recorded under its name: {'eval_train': 'train'} (a split),
        {'eval_big': @big/shapes_input} (a dataset, on eval_split) or
        {'eval_big': (@big/shapes_input, 'train')} (expframe/tasks/named_evals.py).
    """

    def __init__(self, model: Callable[[], keras.Model] = gin.REQUIRED,
                 dataset: Callable[..., tf.data.Dataset] = gin.REQUIRED,
                 optimizer: Callable[[], keras.optimizers.Optimizer] = gin.REQUIRED,
                 label_smoothing: float = 0.0, weight_decay: float = 0.0,
                 train_split: str = "train", eval_split: Optional[str] = "test",
                 evaluations: Optional[Dict[str, Any]] = None):
        if not 0.0 <= label_smoothing < 1.0:
            raise xf.ConfigError(f"ClassificationTask.label_smoothing={label_smoothing!r} must be in [0, 1).")
        if weight_decay < 0:
            raise xf.ConfigError(f"ClassificationTask.weight_decay={weight_decay!r} must be >= 0.")
        self._model_fn, self._dataset_fn, self._optimizer_fn = model, dataset, optimizer
        self.label_smoothing = label_smoothing
        self.weight_decay = weight_decay
        self.train_split, self.eval_split = train_split, eval_split
        self._named = named_evals.parse(f"{type(self).__name__}.evaluations", evaluations, dataset, eval_split)

    def build(self) -> None:
        self.model = self._model_fn()
        self.num_classes = int(self.model.output_shape[-1])
        # A learning-rate schedule built here takes the run's batch and epoch size
        # (expframe/schedules.py): the trainer's batch is the one source of truth. An
        # optimizer update takes k micro-batches with wrap_optimizer.accumulate_steps = k.
        accumulate = gin.get_bindings(xf.wrap_optimizer).get("accumulate_steps", 1)
        with schedules.training_run(self.examples_per_step * accumulate, self.train_examples):
            self.optimizer = xf.wrap_optimizer(self._optimizer_fn())
        self.optimizer.build(self.model.trainable_variables)
        self._decayed = [v for v in self.model.trainable_variables if len(v.shape) >= 2]

    def train_examples(self) -> Optional[int]:
        """Examples in one pass over the train split (None if its size is unknown)."""
        one_pass = self._dataset_fn(split=self.train_split, ctx=tf.distribute.InputContext(), batch_size=1,
                                    training=False, seed=self.seed, deterministic=self.deterministic)
        count = int(one_pass.cardinality())
        return count if count >= 0 else None

    def trackables(self) -> Dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def serving(self) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
        """'serving_default': `image` float32 [None, H, W, C] (the model's input shape),
        preprocessed as the eval pipeline feeds the model -> `class_outputs` of the model
        called with training=False. Where the dataset declares its eval preprocessing
        (`shapes_input`, `imagenet_input`: expframe/data/raw_images.py), also
        `image_tensor` (uint8 of any size), `image_bytes` (encoded images) and
        `tf_example`, with that preprocessing inside; and `top_k_class_names` where it
        names the model's classes (expframe/tasks/image_serving.py)."""
        return classifier_signatures(lambda image: self.model(image, training=False),
                                     tuple(self.model.input_shape[1:]), self.num_classes,
                                     raw_images.of(self._dataset_fn))

    def serving_assets(self) -> Dict[str, str]:
        """`labels.txt` (one class name per line) where the dataset names the model's classes."""
        return labels_asset(class_names(raw_images.of(self._dataset_fn), self.num_classes))

    def keras_model(self) -> keras.Model:
        """The model: its logits are `serving_default`'s `logits`."""
        return self.model

    def _input(self, split, ctx, training):
        return self._dataset_fn(split=split, ctx=ctx, batch_size=ctx.get_per_replica_batch_size(self.global_batch_size),
                                training=training, seed=self.seed, deterministic=self.deterministic)

    def train_input_fn(self, ctx):
        return self._input(self.train_split, ctx, training=True)

    def eval_input_fn(self, ctx):
        return None if self.eval_split is None else self._input(self.eval_split, ctx, training=False)

    def named_evals(self):
        """The bound `evaluations`, each an eval_input_fn of its dataset and split."""
        def input_fn(dataset, split):
            return lambda ctx: dataset(split=split, ctx=ctx, batch_size=ctx.get_per_replica_batch_size(
                self.global_batch_size), training=False, seed=self.seed, deterministic=self.deterministic)
        return {name: input_fn(*source) for name, source in self._named.items()}

    def _cross_entropy(self, labels, logits):
        onehot = tf.one_hot(labels, self.num_classes, dtype=logits.dtype)
        return keras.losses.categorical_crossentropy(
            onehot, logits, from_logits=True, label_smoothing=self.label_smoothing)

    def train_step(self, batch) -> Dict[str, tf.Tensor]:
        images, labels = batch["image"], batch["label"]
        with tf.GradientTape() as tape:
            logits = tf.cast(self.model(images, training=True), tf.float32)
            cross_entropy = tf.reduce_mean(self._cross_entropy(labels, logits))
            terms = {"cross_entropy": cross_entropy}
            # The model's own regularisation losses (kernel_regularizer=..., add_loss), and
            # the task's weight decay: each a separate term of the loss and of the metrics.
            reg_loss = model_losses(self.model)
            if reg_loss is not None:
                terms["reg_loss"] = reg_loss
            if self.weight_decay:
                terms["weight_decay_loss"] = self.weight_decay * tf.add_n([tf.nn.l2_loss(v) for v in self._decayed])
            loss = tf.add_n(list(terms.values()))
        # Scales the loss under loss scaling (mixed_float16), unscales, averages, applies.
        self.optimizer.minimize(loss, self.model.trainable_variables, tape)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), tf.cast(labels, tf.int32)), tf.float32)
        return {"loss": loss, **terms, "accuracy": tf.reduce_mean(correct)}

    def eval_step(self, batch) -> Dict[str, tf.Tensor]:
        images, labels = batch["image"], tf.cast(batch["label"], tf.int32)
        logits = tf.cast(self.model(images, training=False), tf.float32)
        # mask: 0 for the padding that fills the last batches of an exact pass.
        mask = tf.cast(batch["mask"], tf.float32) if "mask" in batch else tf.ones_like(labels, tf.float32)
        out = {
            "count": tf.reduce_sum(mask),
            "loss": tf.reduce_sum(mask * self._cross_entropy(labels, logits)),
            "top1": tf.reduce_sum(mask * tf.cast(tf.math.in_top_k(labels, logits, 1), tf.float32)),
        }
        if self.num_classes > 5:
            out["top5"] = tf.reduce_sum(mask * tf.cast(tf.math.in_top_k(labels, logits, 5), tf.float32))
        return out
