"""The task interface: what an experiment computes, seen by the trainer.

A task is single-device-looking code. The trainer owns the loop, the replicator,
checkpoints and metrics; the task owns its networks, optimizers and steps:

  build()                 inside Replicator.scope(): create models, wrapped
                          optimizers, any state (e.g. a GAN's two networks and two
                          optimizers, D4PG's actor/critic and target networks).
  train_input_fn(ctx)     tf.data.Dataset of per-replica elements for one train
                          step. A GAN yields `disc_steps` sub-batches per element
                          and loops over them inside train_step; D4PG builds it
                          from its replay buffer (filled by actor processes).
  train_step(batch)       replica context: one optimisation step (or a GAN's
                          discriminator steps + generator step); returns a dict of
                          per-replica scalars, reduced by mean. Must contain "loss".
  eval_input_fn(ctx)      tf.data.Dataset of dict batches for evaluation (None: no
                          eval data); keep the partial last batch. The trainer
                          re-batches it to the per-replica batch and adds "mask".
  eval_step(batch)        replica context: returns per-replica SUMS plus "count",
                          each example weighted by batch["mask"] (1 real, 0 the
                          padding that fills the last batches); the trainer sums
                          over replicas and steps and divides, so eval metrics are
                          exact global means over every example, at any replica
                          count (it checks that count equals the real examples).
  evaluate(runner)        optional override for evaluation that is not a sum over
                          batches (FID over generated samples, RL episode returns).
  named_evals()           optional: {name: eval_input_fn} of evaluations of other data
                          besides the run's own (e.g. 'eval_train': the train split),
                          each recorded under its name (expframe/evaluator.py); the
                          same `evaluate` runs on each, reading it through the runner.
  trackables()            dict of objects to checkpoint (models, optimizers, ...).
  train_examples()        optional: examples in one pass over the train split (None:
                          unknown or endless); what `Trainer.train_epochs` and the
                          logged epoch count in (expframe/epochs.py).
  before_train_steps(step, n)  optional, host side: runs before the trainer's next
                          host call of n train steps from `step` (D4PG acts in the
                          environment and fills its replay here).
  after_train_steps(step) optional, host side, after that call: extra train metrics
                          to log (e.g. environment steps/s).
  checkpoint_input        class attribute; False when train_input_fn's position
                          cannot be saved (a generator fed by acting): the trainer
                          leaves the data position out of checkpoints and the task's
                          trackables() carry what it needs to resume.
  write_outputs(dir, step) optional: artefacts such as GAN sample grids.
  close()                 optional: stops what the task started (D4PG's actor processes
                          and render workers); runs on every exit path of a run.
  serving()               optional: {signature name: tf.function with an input_signature,
                          returning a dict of named tensors} for `--mode=export`
                          (expframe/export.py); 'serving_default' among them.
  serving_assets()        optional: {file name: text} the export writes into the
                          SavedModel's assets/ (a classifier's labels.txt); default none.
  keras_model()           optional: the Keras model the export also writes as
                          model.keras, in plain Keras layers (expframe/keras_copy.py);
                          default None: no copy.
  xla_incompatible        class attribute; None, or why XLA cannot compile
                          train_step (e.g. it calls the host): the step then never
                          runs under Replicator.jit_compile, and jit_compile=True is
                          refused before the run starts.
"""

from typing import Any, Callable, Dict, Optional

import keras
import tensorflow as tf

from expframe.errors import ConfigError


class StopRequested(Exception):
    """Raised by `before_train_steps` when a stop signal (SIGINT, SIGTERM) reached the
    learner while it waited there, e.g. for actor processes still starting: waiting on
    would delay the checkpoint-and-exit by minutes."""


class Task:
    """Base class; subclasses override what they need (see module docstring)."""

    #: Examples consumed per train step over all replicas (for examples/s).
    examples_per_step: int = 0
    #: Whether the trainer checkpoints the position of train_input_fn's iterator.
    checkpoint_input: bool = True
    #: None, or why XLA cannot compile train_step (Replicator.jit_compile leaves it uncompiled).
    xla_incompatible: Optional[str] = None
    #: TensorFlow inter-op threads this task's host-side services may hold blocked while
    #: a step runs; run_experiment reserves them in the cpu target's pool before the
    #: Replicator splits the CPU (expframe.replicator.reserve_inter_op_threads).
    host_threads: int = 0

    def setup(self, replicator, global_batch_size: int, seed: int, deterministic: bool) -> None:
        """Called by the trainer before build(): where and how the task runs."""
        self.replicator = replicator
        self.global_batch_size = global_batch_size
        self.per_replica_batch_size = replicator.check_global_batch(global_batch_size)
        self.examples_per_step = global_batch_size
        self.seed = seed
        self.deterministic = deterministic

    def build(self) -> None:
        raise NotImplementedError

    def train_input_fn(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        raise NotImplementedError

    def train_step(self, batch: Any) -> Dict[str, tf.Tensor]:
        raise NotImplementedError

    def eval_input_fn(self, ctx: tf.distribute.InputContext) -> Optional[tf.data.Dataset]:
        return None

    def eval_step(self, batch: Any) -> Dict[str, tf.Tensor]:
        raise NotImplementedError

    def evaluate(self, runner) -> Optional[Dict[str, float]]:
        """Default: sums of eval_step over `runner.eval_steps` batches, divided by count."""
        return runner.evaluate_by_steps()

    def named_evals(self) -> Dict[str, Callable[[tf.distribute.InputContext], Optional[tf.data.Dataset]]]:
        """Evaluations of other data besides the run's own: {name: eval_input_fn}, each
        name `eval_<something>` (expframe/tasks/named_evals.py checks them). The evaluator
        runs `evaluate(runner)` once per name with the runner reading that data, and
        records it apart from the run's eval curve. Default: none."""
        return {}

    def trackables(self) -> Dict[str, Any]:
        raise NotImplementedError

    def train_examples(self) -> Optional[int]:
        """Examples in one pass over the train split, or None where it is unknown or
        endless (the default: a generated stream, a replay buffer). Bindings in epochs
        (`Trainer.train_epochs`) need it; the trainer logs the epoch where it is known."""
        return None

    def before_train_steps(self, step: int, num_steps: int) -> None:
        """Host side, before the trainer runs train steps step+1 .. step+num_steps. May raise
        `StopRequested` when the run was signalled to stop while it waited here (for actors):
        the trainer then checkpoints `step` and exits as for the signal."""

    def after_train_steps(self, step: int) -> Optional[Dict[str, float]]:
        """Host side, after those steps ran (now at `step`); extra train metrics or None."""
        return None

    def write_outputs(self, model_dir: str, step: int) -> None:
        """Optional artefacts written by the chief after each evaluation."""

    def serving(self) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
        """The signatures `--mode=export` saves (expframe/export.py), on the restored weights.

        Returns:
          {name: tf.function with an `input_signature` (named TensorSpecs, batch None)
          returning a dict of named tensors}, 'serving_default' among them. The export
          saves the variables the functions read (plain ones: copies, not DTensors).
        """
        raise ConfigError(f"{type(self).__name__} declares no serving signature: override Task.serving "
                          "(docs/extending.md).")

    def serving_assets(self) -> Dict[str, str]:
        """Files the export writes beside the signatures, into the SavedModel's `assets/`.

        Returns:
          {file name (no folder): text}, e.g. {"labels.txt": one class name per line}.
          Default: none.
        """
        return {}

    def keras_model(self) -> Optional[keras.Model]:
        """The Keras model the export also writes as `model.keras`, or None (the default).

        Return it only where it computes what `serving()['serving_default']` serves (its
        outputs, before any naming or softmax the signature adds): the export writes it in
        plain Keras layers (expframe/keras_copy.py) for `keras.models.load_model`.
        """
        return None

    def close(self) -> None:
        """Releases what the task holds outside TensorFlow (processes, files); called on
        every exit path of a run (normal end, error, signal), also after a failed `setup`."""


def check_step_output(task: Task, method: str, out, key: str, contract: str):
    """`out` if it is a dict holding `key`; else a ConfigError naming the Task contract.

    Runs while the step is traced (Python), so a task that breaks the contract stops
    at its first step with one line, not a KeyError from deep inside the trainer."""
    if isinstance(out, dict) and key in out:
        return out
    got = f"a dict with the keys {sorted(out)}" if isinstance(out, dict) else f"a {type(out).__name__}"
    error = ConfigError(f"{type(task).__name__}.{method} returned {got}, without {key!r}: {contract} "
                        "(the Task contract: docs/extending.md).")
    task.contract_error = error  # tf.function re-raises it as a StagingError: see `contract_error`
    raise error


def contract_error(task: Task, error: Exception) -> Exception:
    """The ConfigError `check_step_output` raised while `task`'s step was traced (which
    TensorFlow re-raised as another type), else `error` itself."""
    found = getattr(task, "contract_error", None)
    return found if isinstance(found, ConfigError) else error


def model_losses(*models: Optional[keras.Layer]) -> Optional[tf.Tensor]:
    """The sum of the models' `losses` (Keras regularisation: `kernel_regularizer=...`,
    `add_loss`) as float32, or None when they have none (None models are skipped). Read it inside the tape, after
    the forward pass (activity losses are the last call's).

    Added whole to each replica's loss: every replica holds the same weights, so the
    term and its gradient are the same on each, and `wrap_optimizer`'s mean over
    replicas counts it once per step, as one device would. (TensorFlow's tutorial
    divides it by the replicas, `tf.nn.scale_regularization_loss`, because there Keras
    sums the gradients; expframe refuses that division.)"""
    losses = [tf.cast(loss, tf.float32) for model in models if model is not None
              for loss in getattr(model, "losses", ())]
    return tf.add_n(losses) if losses else None
