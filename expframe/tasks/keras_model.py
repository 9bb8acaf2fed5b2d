"""A compiled Keras model as a task: its `compile` loss, metrics and optimizer, trained by
expframe's loop on every target, with no step function to write.

Keras 3's `fit` runs under `MirroredStrategy` but fails under `MultiWorkerMirroredStrategy`
and `ParameterServerStrategy` (keras-team/keras#20585). `KerasModelTask` takes the same
compiled model and runs it as any expframe task: checkpoints with exact resume, exact
evaluation, metrics.jsonl, epochs, studies, and the `multi_worker` and `parameter_server`
targets.

What a train step computes, per replica, on its share of the global batch:
  * the compiled loss, as `model.compute_loss` gives it (loss functions with their
    `loss_weights`, plus `model.losses`: regularisers and `add_loss`), as a mean over
    this replica's examples. Keras itself divides every loss by the number of replicas
    under a strategy, because its optimizer then sums the replicas' gradients;
    `wrap_optimizer` averages them instead, so the step multiplies Keras' division back
    out (`xf.num_replicas()`): the convention of every expframe step.
  * the gradients, averaged over replicas and applied by the compiled optimizer, wrapped
    with `xf.wrap_optimizer` (accumulation, clipping and loss scaling come from its
    bindings; a `LossScaleOptimizer` that `compile` put around it under mixed_float16 is
    replaced by the wrapper's own loss scaling).
  * the compiled metrics of this batch (e.g. `accuracy`), from their zero state (Keras'
    stateless metric API), and `reg_loss` (the sum of `model.losses`, part of `loss`) where the
    model has any: the progress line shows each.

Evaluation is exact, as `model.evaluate` on every example once: each eval step adds its
real examples' increments of the compiled metrics' state (their variables are sums,
which this checks when the task is built) and `loss x examples`; the sums over replicas
and batches give the metrics with Keras' own `result`, and the loss as `evaluate`
weights it (each batch's loss by its examples).

Data: `dataset(split, ctx, batch_size, training, seed, deterministic)` (ClassificationTask's
contract) returns batches of dicts (`features`, `labels` and `sample_weight` name the
keys) or Keras' `(x, y)` / `(x, y, sample_weight)` tuples of tensors. Training data is
endless (`.repeat()`) and batched per replica with `drop_remainder=True`.

Gin:
    KerasModelTask.model = @compiled_keras_model      # or your own builder
    compiled_keras_model.model = @resnet
    compiled_keras_model.optimizer = @keras.optimizers.SGD()
    compiled_keras_model.loss = @keras.losses.SparseCategoricalCrossentropy()
    keras.losses.SparseCategoricalCrossentropy.from_logits = True
    compiled_keras_model.metrics = ['accuracy']
    KerasModelTask.dataset = @shapes_input
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import gin
import keras
import numpy as np
import tensorflow as tf

import expframe as xf
from expframe import schedules
from expframe.errors import ConfigError
from expframe.replicator import keras_hooks
from expframe.tasks import named_evals
from expframe.tasks.base import Task

Keys = Union[str, Sequence[str]]

# The compiled metrics live in a private attribute of Keras' Trainer (public:
# `model.metrics`, which mixes them with the loss trackers): check that `compile` still
# sets it (a Keras that renamed it would leave the task without its metrics).
keras_hooks.require_hook(keras.Model, "_compile_metrics", "KerasModelTask",
                         "the compiled metrics of a model could not be found", set_by="compile")


@gin.configurable
def compiled_keras_model(model: Callable[[], keras.Model] = gin.REQUIRED,
                         optimizer: Any = gin.REQUIRED, loss: Any = gin.REQUIRED,
                         metrics: Optional[Sequence[Any]] = None, loss_weights: Any = None,
                         weighted_metrics: Optional[Sequence[Any]] = None) -> keras.Model:
    """`model()` compiled with these arguments of `keras.Model.compile`, for gin users.

    KerasModelTask calls it inside the replicator's scope, where `compile` must run (the
    optimizer's variables are replicated there). A builder of your own that returns a
    compiled model does the same.

    Args:
      model: builds the Keras model (e.g. `@resnet`).
      optimizer, loss, metrics, loss_weights, weighted_metrics: as `keras.Model.compile`
        takes them (objects or names, e.g. `@keras.optimizers.SGD()`, `'accuracy'`).
    """
    built = model()
    built.compile(optimizer=optimizer, loss=loss, metrics=metrics, loss_weights=loss_weights,
                  weighted_metrics=weighted_metrics)
    return built


@gin.configurable
class KerasModelTask(Task):
    """Trains a compiled Keras model with its compile loss, metrics and optimizer (module docstring).

    Example:
      def build():  # called inside the replicator's scope
          model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])
          model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
          return model
      task = KerasModelTask(model=build, dataset=shapes_input)

    Args:
      model: a function of no arguments that builds and compiles the model (e.g.
        `@compiled_keras_model`, or the user's builder), called inside the replicator's
        scope: `compile` must run there.
      dataset: `fn(split, ctx, batch_size, training, seed, deterministic)` returning a
        tf.data.Dataset of this input pipeline's batches of `batch_size` (see module
        docstring), e.g. `@shapes_input`.
      features: for dict batches: the key of the model's input, or a list of keys (the
        model's inputs in order).
      labels: for dict batches: the key of the targets, or a list of keys (one per output).
      sample_weight: for dict batches: the key of per-example weights, or None.
      train_split, eval_split: dataset splits (eval_split None: no evaluation).
      evaluations: named evaluations of other data besides the run's own, as
        `ClassificationTask.evaluations` binds them (expframe/tasks/named_evals.py).
    """

    def __init__(self, model: Callable[[], keras.Model] = gin.REQUIRED,
                 dataset: Callable[..., tf.data.Dataset] = gin.REQUIRED, features: Keys = "image",
                 labels: Keys = "label", sample_weight: Optional[str] = None, train_split: str = "train",
                 eval_split: Optional[str] = "test", evaluations: Optional[Dict[str, Any]] = None):
        self._model_fn, self._dataset_fn = model, dataset
        self.features, self.labels, self.sample_weight = features, labels, sample_weight
        self.train_split, self.eval_split = train_split, eval_split
        self._named = named_evals.parse("KerasModelTask.evaluations", evaluations, dataset, eval_split)

    # -- building ----------------------------------------------------------------------

    def build(self) -> None:
        accumulate = gin.get_bindings(xf.wrap_optimizer).get("accumulate_steps", 1)
        # A learning-rate schedule built by the builder takes the run's batch and epoch size.
        with schedules.training_run(self.examples_per_step * accumulate, self.train_examples):
            self.model = self._model_fn()
        self._check_compiled()
        optimizer = self.model.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            # compile() wraps it under mixed_float16; wrap_optimizer scales the loss itself.
            optimizer = optimizer.inner_optimizer
        # Keras divides the compiled loss by the replicas and `_loss` multiplies it back out:
        # the porting check that refuses a divided loss (wrap_optimizer.allow_divided_loss)
        # would see Keras' division, so it is told that this one is deliberate.
        self.optimizer = xf.wrap_optimizer(optimizer, allow_divided_loss=True)
        # Builds the model, the compiled loss and the metrics' variables here, in the scope
        # and eagerly (not inside the first traced step), on two examples.
        x, y, weights = self._unpack(next(iter(self._input(self.train_split, tf.distribute.InputContext(), 2,
                                                            training=False))))
        y_pred = self.model(x, training=False)
        self.model.compute_loss(x, y, y_pred, weights, training=False)
        self.model.compute_metrics(x, y, y_pred, weights)
        self.model.reset_metrics()
        self.optimizer.build(self.model.trainable_variables)
        self._metrics = self.model._compile_metrics  # pylint: disable=protected-access  (checked at import)
        self._check_additive()
        metric_variables = list(self._metrics.variables) if self._metrics is not None else []
        self._initial_state = [tf.constant(np.asarray(v.numpy())) for v in metric_variables]

    def _check_compiled(self) -> None:
        name = getattr(self._model_fn, "__name__", repr(self._model_fn))
        if not isinstance(self.model, keras.Model):
            raise ConfigError(f"KerasModelTask.model={name} returned a {type(self.model).__name__}, not a "
                              "keras.Model: return the compiled model.")
        if not self.model.compiled or self.model.optimizer is None or self.model.loss is None:
            missing = "compile() was not called" if not self.model.compiled else (
                "it has no optimizer" if self.model.optimizer is None else "it has no loss")
            raise ConfigError(f"KerasModelTask.model={name} returned a model that is not compiled for training "
                              f"({missing}): call model.compile(optimizer=..., loss=..., metrics=...) in it.")

    def _check_additive(self) -> None:
        """Exact evaluation adds each eval batch's increment of the metrics' state: every
        state variable must be a sum (Keras' default aggregation for metric variables)."""
        for metric in self._metrics.metrics if self._metrics is not None else []:
            for v in metric.variables:
                if getattr(v, "aggregation", "sum") != "sum":
                    raise ConfigError(
                        f"KerasModelTask: the compiled metric {metric.name!r} keeps {v.name!r} with "
                        f"aggregation={v.aggregation!r}, not a sum over examples, so its value over the eval "
                        "data cannot be computed exactly from batches; leave it out of compile(metrics=...).")

    def train_examples(self) -> Optional[int]:
        """Examples in one pass over the train split (None if its size is unknown)."""
        one_pass = self._input(self.train_split, tf.distribute.InputContext(), 1, training=False)
        count = int(one_pass.cardinality())
        return count if count >= 0 else None

    def trackables(self) -> Dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    # -- data --------------------------------------------------------------------------

    def _input(self, split: str, ctx, batch_size: int, training: bool, dataset_fn=None) -> tf.data.Dataset:
        dataset = (dataset_fn or self._dataset_fn)(split=split, ctx=ctx, batch_size=batch_size, training=training,
                                                   seed=self.seed, deterministic=self.deterministic)
        if isinstance(dataset.element_spec, dict):
            return dataset
        if not isinstance(dataset.element_spec, tuple) or len(dataset.element_spec) not in (2, 3) or any(
                not isinstance(s, tf.TensorSpec) for s in dataset.element_spec):
            raise ConfigError(f"KerasModelTask.dataset gave elements {dataset.element_spec}: use batches of dicts "
                              "(named by KerasModelTask.features and .labels) or (x, y) / (x, y, sample_weight) "
                              "tuples of tensors.")
        return dataset.map(lambda *t: dict(zip(("x", "y", "sample_weight")[:len(t)], t, strict=True)))

    def train_input_fn(self, ctx):
        return self._input(self.train_split, ctx, ctx.get_per_replica_batch_size(self.global_batch_size), True)

    def eval_input_fn(self, ctx):
        if self.eval_split is None:
            return None
        return self._input(self.eval_split, ctx, ctx.get_per_replica_batch_size(self.global_batch_size), False)

    def named_evals(self):
        """The bound `evaluations`, each an eval_input_fn of its dataset and split."""
        def input_fn(dataset, split):
            return lambda ctx: self._input(split, ctx, ctx.get_per_replica_batch_size(self.global_batch_size), False,
                                           dataset)
        return {name: input_fn(*source) for name, source in self._named.items()}

    def _unpack(self, batch: Dict[str, tf.Tensor]):
        """(x, y, sample_weight) of a dict batch (tuples were turned into x/y/sample_weight)."""
        if "x" in batch and "y" in batch and self.features not in batch:
            return batch["x"], batch["y"], batch.get("sample_weight")

        def pick(keys: Keys, what: str):
            names = [keys] if isinstance(keys, str) else list(keys)
            missing = [k for k in names if k not in batch]
            if missing:
                raise ConfigError(f"KerasModelTask.{what}={keys!r}: the dataset's batches have no {missing[0]!r} "
                                  f"(their keys: {sorted(batch)}).")
            return batch[keys] if isinstance(keys, str) else [batch[k] for k in names]
        weights = pick(self.sample_weight, "sample_weight") if self.sample_weight else None
        return pick(self.features, "features"), pick(self.labels, "labels"), weights

    # -- steps -------------------------------------------------------------------------

    def _loss(self, x, y, y_pred, weights, training: bool) -> tf.Tensor:
        """The compiled loss plus `model.losses`, per replica: Keras' own division by the
        number of replicas (its optimizer sums gradients; ours averages) multiplied back out."""
        loss = self.model.compute_loss(x, y, y_pred, weights, training=training)
        return tf.cast(loss, tf.float32) * float(xf.num_replicas())

    def _batch_metrics(self, y, y_pred, weights) -> List[tf.Tensor]:
        """The compiled metrics' state after this batch alone (from their initial state)."""
        if not self._initial_state:
            return []
        return self._metrics.stateless_update_state(self._initial_state, y, y_pred, sample_weight=weights)

    def train_step(self, batch) -> Dict[str, tf.Tensor]:
        x, y, weights = self._unpack(batch)
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            loss = self._loss(x, y, y_pred, weights, training=True)
            out = {"loss": loss}
            if self.model.losses:  # part of the loss, shown apart (of the weights before this update)
                out["reg_loss"] = tf.add_n([tf.cast(v, tf.float32) for v in self.model.losses])
        self.optimizer.minimize(loss, self.model.trainable_variables, tape)
        if self._initial_state:
            results = self._metrics.stateless_result(self._batch_metrics(y, y_pred, weights))
            out.update({name: tf.cast(value, tf.float32) for name, value in _flat_results(results).items()})
        return out

    def eval_step(self, batch) -> Dict[str, tf.Tensor]:
        x, y, weights = self._unpack(batch)
        y_pred = self.model(x, training=False)
        # Only the real examples: the padding that fills the last batches is left out, as
        # `model.evaluate` never sees it (unweighted compiled metrics ignore sample weights).
        real = batch["mask"] > 0
        y, y_pred = tf.nest.map_structure(lambda t: tf.boolean_mask(t, real), (y, y_pred))
        weights = None if weights is None else tf.nest.map_structure(lambda t: tf.boolean_mask(t, real), weights)
        count = tf.reduce_sum(tf.cast(real, tf.float32))
        out = {"count": count, "loss": self._loss(x, y, y_pred, weights, training=False) * count}
        state = self._batch_metrics(y, y_pred, weights)
        for i, (value, initial) in enumerate(zip(state, self._initial_state, strict=True)):
            out[f"metric_state_{i}"] = tf.cast(value - initial, tf.float32)  # summed in float64 on the host
        return out

    def evaluate(self, runner) -> Optional[Dict[str, float]]:
        """One exact pass (or `Trainer.eval_steps` batches): the loss as `model.evaluate`
        gives it, and each compiled metric's `result` on the summed state."""
        summed = runner.evaluate_sums()
        if summed is None:
            return None
        sums, count = summed
        out = {"loss": float(sums["loss"]) / count}
        if self._initial_state:
            state = [tf.cast(np.asarray(initial, np.float64) + sums[f"metric_state_{i}"], initial.dtype)
                     for i, initial in enumerate(self._initial_state)]
            results = self._metrics.stateless_result(state)
            out.update({name: float(value) for name, value in _flat_results(results).items()})
        return out

    def serving(self) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
        """'serving_default': the model's input (one input, batch None, named as
        `KerasModelTask.features`) -> {"output": the model called with training=False}."""
        if len(self.model.inputs) != 1:
            raise ConfigError(f"KerasModelTask serves a model with one input; this one has {len(self.model.inputs)}: "
                              "override KerasModelTask.serving (docs/extending.md).")
        spec = self.model.inputs[0]
        name = self.features if isinstance(self.features, str) else "x"

        @tf.function(input_signature=[tf.TensorSpec([None, *spec.shape[1:]], spec.dtype, name=name)])
        def serve(x):
            return {"output": tf.cast(self.model(x, training=False), tf.float32)}
        return {"serving_default": serve}

    def keras_model(self) -> keras.Model:
        """The model (uncompiled in the copy): its output is `serving_default`'s `output`."""
        return self.model


def _flat_results(results: Dict[str, Any]) -> Dict[str, tf.Tensor]:
    """The compiled metrics' results as scalars: a metric whose result is a dict gives each
    value under its own name, one whose result is a vector (e.g. F1Score per class) each
    element as `name_i`."""
    out = {}
    for name, value in results.items():
        if isinstance(value, dict):
            out.update(_flat_results(value))
            continue
        value = tf.convert_to_tensor(value)
        if value.shape.rank == 0:
            out[name] = value
        elif value.shape.is_fully_defined():
            flat = tf.reshape(value, [-1])
            out.update({f"{name}_{i}": flat[i] for i in range(int(flat.shape[0]))})
        else:
            raise ConfigError(f"KerasModelTask: the compiled metric {name!r} gives a result of unknown shape "
                              f"{value.shape}; leave it out of compile(metrics=...).")
    return out
