"""The host loop: decides when to run train steps, log, evaluate, checkpoint and stop.

What happens at those moments lives beside it: `Replicator.run_steps` runs the steps
(on every target), `Checkpointer` saves and restores (with `DataPosition`),
`Evaluator` evaluates, `Chrono` times training alone, `RunFiles` writes.
"""

import datetime
import math
import os
import signal
import time
from typing import Any, Dict, Optional, Tuple

import gin
import tensorflow as tf

from expframe import dir_lock, epochs, interrupts, run_files
from expframe.best_checkpoint import BestCheckpoint, check_binding
from expframe.checkpointer import Checkpointer
from expframe.chrono import Chrono
from expframe.data_position import DataPosition
from expframe.errors import ConfigError, RunError
from expframe.evaluator import Evaluator
from expframe.replicator import ReplicatedOptimizer, data_service
from expframe.tasks.base import StopRequested, Task, check_step_output, contract_error

_positive_int = epochs.positive_int


def accumulate_steps_of(task: Task) -> int:
    """Micro-batches per optimizer update: the `accumulate_steps` of the task's wrapped
    optimizers (found in its trackables), which must agree; 1 if it has none."""
    found = {}

    def visit(name, obj):
        if isinstance(obj, ReplicatedOptimizer):
            found[name] = obj.accumulate_steps
        elif isinstance(obj, dict):
            for key, value in obj.items():
                visit(f"{name}.{key}" if name else str(key), value)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(f"{name}[{i}]", value)

    visit("", task.trackables())
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {k}" for name, k in sorted(found.items()))
        raise ConfigError(
            f"{type(task).__name__}'s optimizers accumulate different numbers of micro-batches per update "
            f"(wrap_optimizer.accumulate_steps: {listed}); a train step is one update of each, so bind the "
            "same wrap_optimizer.accumulate_steps for all of them.")
    return next(iter(found.values()), 1)


@gin.configurable
class Trainer:
    """Runs a Task on a Replicator: train, evaluate, checkpoint, log.

    Example:
      trainer = Trainer(train_steps=1000, global_batch_size=128)
      trainer.prepare(replicator, task, seed=0, deterministic=False)
      trainer.restore(out.checkpoint_dir)
      trainer.train(out, evaluate=True)

    Args:
      train_steps: total optimizer updates (steps). With `wrap_optimizer.accumulate_steps
        = k` each step consumes k micro-batches. Bind it or `train_epochs`, not both.
      global_batch_size: examples per micro-batch over all replicas (the input
        pipeline's batch): a step consumes k x global_batch_size examples.
      steps_per_loop: steps per host call, run inside one tf.function.
      log_every_steps: cadence of the progress line and train metrics.
      eval_every_steps: cadence of evaluation (None: only at the end).
      eval_steps: eval batches per evaluation (None: one pass over the eval split).
      checkpoint_every_steps: cadence of checkpoints (also written at the end and on
        SIGTERM/SIGINT); None: 1000, or `checkpoint_every_epochs`.
      max_checkpoints: how many recent checkpoints to keep.
      best_checkpoint: (eval metric, 'max' or 'min'), e.g. ('top1', 'max'): keep a copy of
        the best evaluated checkpoint in model_dir/best/ (expframe/best_checkpoint.py);
        None keeps none.
      profile_steps: (first, last): write a TensorBoard profile of train steps first to
        last (counted from 1, as the progress line counts) into model_dir/train/plugins/
        profile/ (`tf.profiler.experimental`); None (the default) profiles nothing and
        costs nothing.
      train_epochs: the run's length in epochs instead of `train_steps`: an epoch is
        train examples // (global_batch_size x k) steps, rounded down as
        `WarmupSchedule` counts it (expframe/epochs.py); the task must know its train
        split's size (`Task.train_examples`). May be fractional.
      eval_every_epochs, checkpoint_every_epochs: those cadences in epochs (instead of
        `eval_every_steps`, `checkpoint_every_steps`).
      data_service: where the train input is prepared: None (the default) in this
        process, or by the tf.data service that `expframe.launch --data_service_workers`
        started; 'local:K' starts K shards in this process; 'host:port,...' names
        shards started elsewhere; 'off' ignores the launcher's. The steps read the
        same stream either way (expframe/replicator/data_service.py, docs/running.md).

    `prepare` resolves the bindings in epochs to steps: `resolved_steps` holds them under
    the *_steps names ({"Trainer.train_steps": 640}), which the run records in
    resolved.json, so a resume that would count other steps is refused.
    """

    def __init__(self, train_steps: Optional[int] = None, global_batch_size: int = gin.REQUIRED,
                 steps_per_loop: int = 100, log_every_steps: int = 100,
                 eval_every_steps: Optional[int] = None, eval_steps: Optional[int] = None,
                 checkpoint_every_steps: Optional[int] = None, max_checkpoints: int = 3,
                 best_checkpoint: Optional[Tuple[str, str]] = None,
                 profile_steps: Optional[Tuple[int, int]] = None, train_epochs: Optional[float] = None,
                 eval_every_epochs: Optional[float] = None, checkpoint_every_epochs: Optional[float] = None,
                 data_service: Optional[str] = None):
        self.data_service = data_service
        epochs.check_bindings({"train": train_steps, "eval_every": eval_every_steps,
                               "checkpoint_every": checkpoint_every_steps},
                              {"train": train_epochs, "eval_every": eval_every_epochs,
                               "checkpoint_every": checkpoint_every_epochs})
        self.train_epochs, self.eval_every_epochs = train_epochs, eval_every_epochs
        self.checkpoint_every_epochs = checkpoint_every_epochs
        self.train_steps = _positive_int("Trainer.train_steps", train_steps, allow_none=True)
        self.global_batch_size = _positive_int("Trainer.global_batch_size", global_batch_size)
        self.steps_per_loop = _positive_int("Trainer.steps_per_loop", steps_per_loop)
        self.log_every_steps = _positive_int("Trainer.log_every_steps", log_every_steps)
        self.eval_every_steps = _positive_int("Trainer.eval_every_steps", eval_every_steps, allow_none=True)
        self.eval_steps = _positive_int("Trainer.eval_steps", eval_steps, allow_none=True)
        self.checkpoint_every_steps = _positive_int("Trainer.checkpoint_every_steps", checkpoint_every_steps,
                                                    allow_none=True)
        if self.checkpoint_every_steps is None and self.checkpoint_every_epochs is None:
            self.checkpoint_every_steps = 1000
        self.max_checkpoints = _positive_int("Trainer.max_checkpoints", max_checkpoints)
        self.best_checkpoint = check_binding(best_checkpoint)
        self._profile_binding = profile_steps
        self.profile_steps = None if self.train_steps is None else _profile_window(profile_steps, self.train_steps)
        self.steps_per_epoch: Optional[int] = None  # known in `prepare` where the task knows its train data
        self.resolved_steps: Dict[str, int] = {}
        self._stop_signal = None
        self._progressed = False

    # -- set-up (nothing is written here) ---------------------------------------------

    def prepare(self, replicator, task: Task, seed: int, deterministic: bool) -> None:
        """Builds the task in the replicator's scope, its input, checkpointer and evaluator."""
        self.rep, self.task = replicator, task
        if task.xla_incompatible:  # refused here, before anything is built or written, if XLA is asked for
            replicator.exclude_from_xla(task.train_step, f"{type(task).__name__}'s train step {task.xla_incompatible}")
        task.setup(replicator, self.global_batch_size, seed, deterministic)
        with replicator.scope():
            task.build()
            replicator.check_variables(task.trackables(), type(task).__name__)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.accumulate_steps = accumulate_steps_of(task)
        self._resolve_epochs(task)
        service = data_service.resolve(self.data_service)
        if replicator.coordinator is not None:
            if service is not None:
                raise ConfigError("Trainer.data_service: the parameter_server target's per-worker pipelines cannot "
                                  "be served in order; unset it (or use the multi_worker target).")
            # parameter_server: per-worker pipelines, whose position cannot be checkpointed.
            self.train_iterator, position = replicator.per_worker_iterator(task.train_input_fn), None
        else:
            self.train_iterator = iter(replicator.distribute(task.train_input_fn, self.global_batch_size, service))
            if service is not None:
                print(f"expframe: {service.describe()}", flush=True)
            position = self.train_iterator if task.checkpoint_input else None
        self.checkpointer = Checkpointer(replicator, self.step, task.trackables(),
                                         DataPosition(replicator, position, self.max_checkpoints),
                                         self.max_checkpoints)
        self.evaluator = Evaluator(replicator, task, self.global_batch_size, self.eval_steps)

    def _resolve_epochs(self, task: Task) -> None:
        """The steps of the bindings given in epochs, and the epoch size for the logged
        epoch (expframe/epochs.py). Without a binding in epochs the epoch is logged
        where the task knows its train data's size, and nothing is refused."""
        names = [name for name in ("train", "eval_every", "checkpoint_every")
                 if getattr(self, f"{name}_epochs") is not None]
        per_step = (task.examples_per_step or self.global_batch_size) * self.accumulate_steps
        try:
            self.steps_per_epoch = epochs.steps_per_epoch(task.train_examples(), per_step, type(task).__name__)
        except Exception:  # noqa: BLE001  (refused below only where a binding needs it)
            if names:
                raise
        for name in names:
            steps = epochs.steps(f"Trainer.{name}_epochs", getattr(self, f"{name}_epochs"), self.steps_per_epoch)
            setattr(self, f"{name}_steps", steps)
            self.resolved_steps[f"Trainer.{name}_steps"] = steps
        self.profile_steps = _profile_window(self._profile_binding, self.train_steps)

    def evaluation_objects(self) -> Dict[str, Any]:
        """The step and the task's objects without the data position: what an evaluation
        or an export restores (it needs neither the train input nor its place), as the
        children of a checkpoint's root (`checkpointer.read_checkpoint`)."""
        return {"step": self.step, **self.task.trackables()}

    def restore(self, checkpoint_dir: str, read_dir: Optional[str] = None) -> int:
        """See `Checkpointer.restore`; returns the step to continue from."""
        return self.checkpointer.restore(checkpoint_dir, read_dir)

    def trace(self) -> None:
        """Traces the train step before anything is written (`Replicator.trace_steps`): a
        configuration error found only while tracing (e.g. gradients of an unscaled
        loss under loss scaling) then leaves the model_dir untouched. The first host
        call reuses the trace."""
        self._contract_errors(self.rep.trace_steps, self._train_step, self.train_iterator,
                              self.steps_per_loop * self.accumulate_steps)

    def run_eval(self, out: "run_files.RunFiles", step: int) -> Dict[str, float]:
        """Evaluates now (see `Evaluator.run`)."""
        return self.evaluator.run(out, step)

    def run_train_steps(self, num_steps: int) -> Dict[str, float]:
        """One host call: `num_steps` optimizer updates, each of `accumulate_steps` calls of
        the task's train_step (micro-batches); returns their metrics averaged over them."""
        micro_batches = num_steps * self.accumulate_steps
        metrics = self._contract_errors(self.rep.run_steps, self._train_step, self.train_iterator, micro_batches)
        self.step.assign_add(num_steps)
        return metrics

    def _contract_errors(self, fn, *args):
        """fn(*args); an error of the task's step contract, raised while tracing, becomes
        its one-line ConfigError (others are re-raised as they came)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  (re-raised: the contract's one line, or as it came)
            error = contract_error(self.task, e)
            if error is e:
                raise
            raise error from None

    def _train_step(self, batch) -> Dict[str, tf.Tensor]:
        """The task's train_step, its output checked against the contract while it is traced."""
        return check_step_output(self.task, "train_step", self.task.train_step(batch), "loss",
                                 "a train step returns a dict of per-replica scalars with the key 'loss'")

    # -- the loop ---------------------------------------------------------------------

    def _handle_signal(self, signum, frame):  # pylint: disable=unused-argument
        """First signal: finish the current host call, checkpoint, exit 0. One that arrives
        before any step of this run finished (still tracing: nothing new to save) stops
        the run at once (`StartupInterrupt`: one line, exit 128 + signal); a second
        signal exits at once. Either way the last checkpoint stays as it was."""
        if not self._progressed:
            raise interrupts.StartupInterrupt(signum)
        if self._stop_signal is not None:
            raise SystemExit(128 + signum)
        self._stop_signal = signum

    def _next_boundary(self, step: int) -> int:
        ends = [self.train_steps, _next_multiple(step, self.log_every_steps),
                _next_multiple(step, self.checkpoint_every_steps), step + self.steps_per_loop]
        if self.profile_steps:  # the profile starts before step `first` and ends after step `last`
            ends += [s for s in (self.profile_steps[0] - 1, self.profile_steps[1]) if s > step]
        if self.eval_every_steps:
            ends.append(_next_multiple(step, self.eval_every_steps))
        return min(ends)

    def train(self, out: "run_files.RunFiles", evaluate: bool) -> Dict:
        """Trains to train_steps from the restored step. Returns the last eval metrics."""
        step = int(self.step.numpy())
        previous = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        wrote_operative = False
        last_eval = {}
        chrono, started = Chrono(), time.time()
        best = self._best_keeper(out) if evaluate else None
        profiling = False
        try:
            while step < self.train_steps:
                num = self._next_boundary(step) - step
                if self.profile_steps and not profiling and self.profile_steps[0] - 1 <= step < self.profile_steps[1]:
                    profiling = self._start_profile(out, step)
                with chrono.measure(num):
                    try:
                        self.task.before_train_steps(step, num)
                    except StopRequested:
                        if self._stop_signal is None:
                            raise  # only a signal this loop saw ends the run here
                        return self._preempted(out, step)
                    metrics = self.run_train_steps(num)
                    if not self._progressed:
                        self._progressed = True
                        interrupts.disarm()  # from here on, a signal checkpoints and exits 0
                    step = int(self.step.numpy())
                    metrics.update(self.task.after_train_steps(step) or {})
                if profiling and step >= self.profile_steps[1]:
                    profiling = self._stop_profile(out, step)
                if not math.isfinite(metrics["loss"]):
                    raise RunError(
                        f"loss is {metrics['loss']} at step {step}; stopped. The last good checkpoint "
                        f"in {out.checkpoint_dir} is intact (lower the learning rate, or check the data).")
                if not wrote_operative:
                    out.write_operative_config(gin.operative_config_str(), step)
                    wrote_operative = True
                if step % self.log_every_steps == 0 or step == self.train_steps:
                    self._log(out, step, metrics, chrono.lap())
                if evaluate and self.eval_every_steps and step % self.eval_every_steps == 0 and step < self.train_steps:
                    last_eval = self.evaluator.run(out, step)
                    self._keep_best(best, out, step, last_eval)
                if step % self.checkpoint_every_steps == 0 or step == self.train_steps:
                    self._save(out, step)
                # Every worker stops at the same step if any of them was signalled.
                if self.rep.agree(float(self._stop_signal is not None), "max"):
                    self._stop_signal = self._stop_signal or signal.SIGTERM
                    return self._preempted(out, step)
            if evaluate:
                last_eval = self.evaluator.run(out, step)
                self._keep_best(best, out, step, last_eval)
        finally:
            if profiling:
                self._stop_profile(out, step)
            for s, handler in previous.items():
                signal.signal(s, handler)
        if not wrote_operative:
            out.write_operative_config(gin.operative_config_str(), step)
        return {"eval": last_eval, "step": step, "wall_time_s": time.time() - started}

    def _save(self, out: "run_files.RunFiles", step: int) -> None:
        """A checkpoint, then metrics.jsonl fsynced (no saved checkpoint is ahead of its
        metrics), then this segment's wall time recorded (`RunFiles.record_segment`)."""
        out.last_good = self.checkpointer.save()
        out.sync_metrics(step)
        out.record_segment(step)  # this start's wall time so far, kept for the run's total

    def _best_keeper(self, out: "run_files.RunFiles") -> Optional[BestCheckpoint]:
        if self.best_checkpoint is None:
            return None
        return BestCheckpoint(out.shared_dir, *self.best_checkpoint, write_dir=out.model_dir)

    def _keep_best(self, best: Optional[BestCheckpoint], out: "run_files.RunFiles", step: int,
                   metrics: Dict[str, float]) -> None:
        """The best checkpoint after an evaluation, unless a continuous evaluator keeps it."""
        if best is None or not metrics:
            return
        # A continuous evaluator on this model_dir keeps the best. Every worker decides alike:
        # they all take part in writing the copy.
        if self.rep.agree(float(dir_lock.is_held(os.path.join(out.shared_dir, dir_lock.EVALUATOR))), "max"):
            return
        line = best.consider(step, metrics, self.checkpointer.checkpoint)
        if line:
            out.progress(line)

    def _start_profile(self, out: "run_files.RunFiles", step: int) -> bool:
        logdir = os.path.join(out.model_dir, "train")
        tf.profiler.experimental.start(logdir)
        out.progress(f"profiling train steps {step + 1} to {self.profile_steps[1]} (Trainer.profile_steps) "
                     f"into {logdir}")
        return True

    def _stop_profile(self, out: "run_files.RunFiles", step: int) -> bool:
        tf.profiler.experimental.stop()
        out.progress(f"profile written at step {step}: tensorboard --logdir {out.model_dir} (Profile tab; "
                     "needs tensorboard-plugin-profile: pip install -e '.[profile]')")
        return False

    def _preempted(self, out: "run_files.RunFiles", step: int) -> Dict:
        """After a stop signal: checkpoint the step reached, say so, and end the loop."""
        self._save(out, step)
        out.progress(f"received {signal.Signals(self._stop_signal).name} at step {step}: "
                     f"checkpoint saved; rerun the same command to resume")
        return {"preempted": True, "step": step}

    def _log(self, out: "run_files.RunFiles", step: int, metrics: Dict[str, float], steps_per_sec: float) -> None:
        """Train metrics and the progress line; speed and ETA count training time only (Chrono)."""
        rate = steps_per_sec * self.accumulate_steps * self.task.examples_per_step
        epoch = None if self.steps_per_epoch is None else epochs.epoch_at(step, self.steps_per_epoch)
        record = dict(metrics, examples_per_sec=rate)
        if epoch is not None:
            record["epoch"] = epoch
        out.log_metrics(step, "train", record)
        eta = (self.train_steps - step) / steps_per_sec if steps_per_sec > 0 else 0.0
        out.progress(progress_line(step, self.train_steps, metrics, rate, eta, epoch))


def _number(value: float) -> str:
    """4 decimals in the everyday range, else 4 significant digits (1.234e-05, 1.235e+06)."""
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.4g}"


def progress_line(step: int, train_steps: int, metrics: Dict[str, float], examples_per_sec: float,
                  eta_s: float, epoch: Optional[float] = None) -> str:
    """The progress line: `step 40/100  epoch 1.25  loss 0.6931  accuracy 0.5000  512.0 examples/s  eta 0:00:12`.

    Args:
      step: the step reached.
      train_steps: the run's last step.
      metrics: the task's train metrics (train_step's outputs and after_train_steps'), shown
        under the names the task gives them, `loss` first, then in the task's order.
      examples_per_sec: training speed.
      eta_s: seconds of training left.
      epoch: the epoch reached (expframe/epochs.py), or None where the train data's size
        is unknown (then not shown).
    """
    names = ["loss"] * ("loss" in metrics) + [name for name in metrics if name != "loss"]
    shown = "".join(f"  {name} {_number(float(metrics[name]))}" for name in names)
    at = f"  epoch {epoch:.2f}" if epoch is not None else ""
    return (f"step {step}/{train_steps}{at}{shown}  {examples_per_sec:,.1f} examples/s  "
            f"eta {datetime.timedelta(seconds=int(eta_s))}")


def _profile_window(value, train_steps: int) -> Optional[Tuple[int, int]]:
    """`Trainer.profile_steps` checked: None, or (first, last) with 1 <= first <= last <= train_steps."""
    if value is None:
        return None
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
    if not ok or not 1 <= value[0] <= value[1] <= train_steps:
        raise ConfigError(f"Trainer.profile_steps={value!r} must be (first, last) train steps with 1 <= first <= "
                          f"last <= Trainer.train_steps ({train_steps}), e.g. (10, 15); or None.")
    return tuple(value)


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every
