"""The host loop: steps_per_loop steps per tf.function call, eval, checkpoints, metrics, resume."""

import datetime
import math
import os
import signal
import time
from typing import Dict, Optional

import gin
import tensorflow as tf

from expframe import run_files
from expframe.data import masked
from expframe.errors import ConfigError, RunError
from expframe.replicator.replicator import mean_over_steps
from expframe.tasks.base import Task


def _positive_int(binding: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{binding}={value!r} must be a positive integer{' or None' if allow_none else ''}.")
    return value


@gin.configurable
class Trainer:
    """Runs a Task on a Replicator: train, evaluate, checkpoint, log.

    Args:
      train_steps: total optimizer steps.
      global_batch_size: examples per step over all replicas.
      steps_per_loop: steps per host call, run inside one tf.function.
      log_every_steps: cadence of the progress line and train metrics.
      eval_every_steps: cadence of evaluation (None: only at the end).
      eval_steps: eval batches per evaluation (None: one pass over the eval split).
      checkpoint_every_steps: cadence of checkpoints (also written at the end and on
        SIGTERM/SIGINT).
      max_checkpoints: how many recent checkpoints to keep.
    """

    def __init__(self, train_steps: int = gin.REQUIRED, global_batch_size: int = gin.REQUIRED,
                 steps_per_loop: int = 100, log_every_steps: int = 100,
                 eval_every_steps: Optional[int] = None, eval_steps: Optional[int] = None,
                 checkpoint_every_steps: int = 1000, max_checkpoints: int = 3):
        self.train_steps = _positive_int("Trainer.train_steps", train_steps)
        self.global_batch_size = _positive_int("Trainer.global_batch_size", global_batch_size)
        self.steps_per_loop = _positive_int("Trainer.steps_per_loop", steps_per_loop)
        self.log_every_steps = _positive_int("Trainer.log_every_steps", log_every_steps)
        self.eval_every_steps = _positive_int("Trainer.eval_every_steps", eval_every_steps, allow_none=True)
        self.eval_steps = _positive_int("Trainer.eval_steps", eval_steps, allow_none=True)
        self.checkpoint_every_steps = _positive_int("Trainer.checkpoint_every_steps", checkpoint_every_steps)
        self.max_checkpoints = _positive_int("Trainer.max_checkpoints", max_checkpoints)
        self._stop_signal = None
        self._progressed = False

    # -- set-up (nothing is written here) ---------------------------------------------

    def prepare(self, replicator, task: Task, seed: int, deterministic: bool) -> None:
        """Builds the task in the replicator's scope and its input; validates the config."""
        self.rep, self.task = replicator, task
        task.setup(replicator, self.global_batch_size, seed, deterministic)
        with replicator.scope():
            task.build()
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.asynchronous = replicator.coordinator is not None
        if self.asynchronous:
            # parameter_server: per-worker pipelines, whose position cannot be checkpointed.
            self.train_iterator = replicator.per_worker_iterator(task.train_input_fn)
            self.checkpoint = tf.train.Checkpoint(step=self.step, **task.trackables())
        else:
            self.train_iterator = iter(replicator.distribute(task.train_input_fn, self.global_batch_size))
            data = {"data": self.train_iterator.iterator} if task.checkpoint_input else {}
            self.checkpoint = tf.train.Checkpoint(step=self.step, **data, **task.trackables())
            # A non-chief worker's own data position (see _own_data_position).
            self._data_checkpoint = tf.train.Checkpoint(data=self.train_iterator.iterator)
        self._train_loop = tf.function(self._loop_body)
        # Takes a plain iterator, so a new evaluation's iterator does not retrace it.
        self._eval_step = tf.function(self._eval_body)

    def _loop_body(self, iterator, num_steps):
        """num_steps replicated train steps; returns metrics averaged over them."""
        def one_step():
            out = self.rep.reduce(self.rep.run(self.task.train_step, iterator.get_next()), "mean")
            self.step.assign_add(1)
            return out

        return mean_over_steps(one_step, num_steps)

    # -- checkpoints ------------------------------------------------------------------

    def _run_steps(self, num: int) -> Dict[str, float]:
        """num train steps: one tf.function call, or (parameter_server) spread over the workers."""
        if not self.asynchronous:
            metrics = self._train_loop(self.train_iterator, tf.constant(num, tf.int32))
            return {k: float(v) for k, v in metrics.items()}
        workers = self.rep.num_workers
        chunks = [num // workers + (1 if i < num % workers else 0) for i in range(workers)]
        remote = [(n, self.rep.schedule_steps(self.task.train_step, self.train_iterator, n)) for n in chunks if n]
        self.rep.join()
        self.step.assign_add(num)
        fetched = [(n, self.rep.fetch(r)) for n, r in remote]
        return {k: sum(n * float(m[k]) for n, m in fetched) / num for k in fetched[0][1]}

    def restore(self, checkpoint_dir: str, read_dir: Optional[str] = None) -> int:
        """Restores the newest readable checkpoint; returns its step (0 if none).

        Checkpoints are written to `checkpoint_dir` and read from `read_dir` (default
        the same): on a multi-worker cluster every worker resumes from the chief's.

        TensorFlow writes a checkpoint's data files first and then atomically
        rewrites the `checkpoint` index, so a crash mid-save leaves the previous
        checkpoint as the latest. Should the newest still be unreadable, older ones
        are tried in turn.
        """
        self.manager = tf.train.CheckpointManager(self.checkpoint, checkpoint_dir,
                                                  max_to_keep=self.max_checkpoints)
        self._shared_dir = read_dir or checkpoint_dir
        readable = self.manager.checkpoints
        if read_dir and read_dir != checkpoint_dir:
            state = tf.train.get_checkpoint_state(read_dir)
            readable = list(state.all_model_checkpoint_paths) if state else []
        for path in reversed(readable):
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
            except (tf.errors.OpError, ValueError, AssertionError) as e:
                if "not found in checkpoint" in str(e) or "Unresolved object" in str(e):
                    raise ConfigError(
                        f"the checkpoint {path} does not match this experiment's model "
                        "(use a new --model_dir, or the config it was written with).") from None
                print(f"expframe: could not read {path} ({type(e).__name__}); trying an older checkpoint", flush=True)
                continue
            step = int(self.step.numpy())
            self._restore_worker_data(step)
            return step
        return 0

    def save(self) -> str:
        step = int(self.step.numpy())
        if self._own_data_position():
            tf.io.gfile.makedirs(self._data_prefix())
            self._data_checkpoint.write(self._data_prefix(step))
            self._prune_data()
        return self.manager.save(checkpoint_number=step)

    # Every worker reads its own shard, so its data position (shuffle buffer included)
    # is its own: the chief's checkpoint holds worker 0's; each other worker writes its
    # own under <chief's checkpoints>/data/, keyed by worker count, index and step.

    def _own_data_position(self) -> bool:
        return not self.asynchronous and self.task.checkpoint_input and self.rep.num_workers > 1 and self.rep.worker_index > 0

    def _data_prefix(self, step=None) -> str:
        folder = os.path.join(self._shared_dir, "data", f"{self.rep.num_workers}-workers",
                              f"worker-{self.rep.worker_index}")
        return folder if step is None else os.path.join(folder, f"step-{step}")

    def _restore_worker_data(self, step: int) -> None:
        if not self._own_data_position():
            return
        prefix = self._data_prefix(step)
        try:
            self._data_checkpoint.read(prefix).assert_consumed()
        except (tf.errors.OpError, ValueError, AssertionError) as e:
            print(f"expframe: worker {self.rep.worker_index} could not read its data position {prefix} "
                  f"({type(e).__name__}); it continues from the chief's, so its examples may repeat "
                  "or be skipped until the next epoch", flush=True)

    def _prune_data(self) -> None:
        """Keeps this worker's newest max_checkpoints + 1 data positions."""
        folder = self._data_prefix()
        steps = sorted(int(name[len("step-"):-len(".index")]) for name in tf.io.gfile.listdir(folder)
                       if name.startswith("step-") and name.endswith(".index"))
        for old in steps[:-(self.max_checkpoints + 1)]:
            for path in tf.io.gfile.glob(os.path.join(folder, f"step-{old}.*")):
                tf.io.gfile.remove(path)

    # -- the loop ---------------------------------------------------------------------

    def _handle_signal(self, signum, frame):  # pylint: disable=unused-argument
        """First signal: finish the current host call, checkpoint, exit 0. A second signal,
        or one that arrives before any step of this run finished (still tracing: nothing
        new to save), exits at once; the last checkpoint stays as it was."""
        if self._stop_signal is not None or not self._progressed:
            raise SystemExit(128 + signum)
        self._stop_signal = signum

    def _next_boundary(self, step: int) -> int:
        ends = [self.train_steps, _next_multiple(step, self.log_every_steps),
                _next_multiple(step, self.checkpoint_every_steps), step + self.steps_per_loop]
        if self.eval_every_steps:
            ends.append(_next_multiple(step, self.eval_every_steps))
        return min(ends)

    def train(self, out: "run_files.RunFiles", evaluate: bool) -> Dict:
        """Trains to train_steps from the restored step. Returns the last eval metrics."""
        step = int(self.step.numpy())
        previous = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        wrote_operative = False
        last_eval = {}
        t_log, step_log, started = time.time(), step, time.time()
        try:
            while step < self.train_steps:
                num = self._next_boundary(step) - step
                self.task.before_train_steps(step, num)
                metrics = self._run_steps(num)
                self._progressed = True
                step = int(self.step.numpy())
                metrics.update(self.task.after_train_steps(step) or {})
                if not math.isfinite(metrics["loss"]):
                    raise RunError(
                        f"loss is {metrics['loss']} at step {step}; stopped. The last good checkpoint "
                        f"in {out.checkpoint_dir} is intact (lower the learning rate, or check the data).")
                if not wrote_operative:
                    out.write_operative_config(gin.operative_config_str())
                    wrote_operative = True
                if step % self.log_every_steps == 0 or step == self.train_steps:
                    now = time.time()
                    rate = (step - step_log) * self.task.examples_per_step / max(now - t_log, 1e-9)
                    out.log_metrics(step, "train", dict(metrics, examples_per_sec=rate))
                    eta = (self.train_steps - step) * (now - t_log) / max(step - step_log, 1)
                    out.progress(f"step {step}/{self.train_steps}  loss {metrics['loss']:.4f}  "
                                 f"{rate:,.1f} examples/s  eta {datetime.timedelta(seconds=int(eta))}")
                    t_log, step_log = now, step
                if evaluate and self.eval_every_steps and step % self.eval_every_steps == 0 and step < self.train_steps:
                    last_eval = self.run_eval(out, step)
                if step % self.checkpoint_every_steps == 0 or step == self.train_steps:
                    self.save()
                # Every worker stops at the same step if any of them was signalled.
                if self.rep.agree(float(self._stop_signal is not None), "max"):
                    self._stop_signal = self._stop_signal or signal.SIGTERM
                    self.save()
                    out.progress(f"received {signal.Signals(self._stop_signal).name} at step {step}: "
                                 f"checkpoint saved; rerun the same command to resume")
                    return {"preempted": True, "step": step}
            if evaluate:
                last_eval = self.run_eval(out, step)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if not wrote_operative:
            out.write_operative_config(gin.operative_config_str())
        return {"eval": last_eval, "step": step, "wall_time_s": time.time() - started}

    # -- evaluation -------------------------------------------------------------------

    def run_eval(self, out, step: int) -> Dict[str, float]:
        metrics = self.task.evaluate(self)
        if metrics:
            out.log_metrics(step, "eval", metrics)
            out.progress("eval at step {}: {}".format(
                step, "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())))
        if self.rep.is_chief:
            self.task.write_outputs(out.model_dir, step)
        return metrics or {}

    def evaluate_by_steps(self) -> Optional[Dict[str, float]]:
        """Sums of the task's eval_step over the eval data, divided by the example count.

        With `eval_steps` None: one exact pass, every example once (see
        expframe/data/masked.py); else `eval_steps` batches, cycling the data.
        """
        workers = 1 if self.asynchronous else self.rep.num_workers
        ctx = tf.distribute.InputContext(workers, self.rep.worker_index, self.rep.num_replicas)
        dataset = self.task.eval_input_fn(ctx)
        if dataset is None:
            return None
        full_pass = self.eval_steps is None
        if full_pass and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ConfigError("Trainer.eval_steps is None (one pass over the eval data) but the eval "
                              "data repeats forever; set Trainer.eval_steps or stop repeating it.")
        per_replica = self.global_batch_size // self.rep.num_replicas
        try:
            batches = masked.masked_batches(dataset, per_replica, full_pass)
        except TypeError as e:
            raise ConfigError(f"{type(self.task).__name__}.eval_input_fn: {e}") from None
        if self.asynchronous:
            iterator = iter(batches)
        else:
            iterator = self.rep.distribute(lambda _: batches).plain_iterator()
        totals, steps = {}, 0
        while True:  # a full pass ends at the first step without a real example on any replica
            sums = {k: float(v) for k, v in self._eval_step(iterator).items()}
            if full_pass and sums[_REAL] == 0:
                break
            totals = {k: totals.get(k, 0.0) + v for k, v in sums.items()}
            steps += 1
            if not full_pass and steps == self.eval_steps:
                break
        real = totals.pop(_REAL, 0.0)
        if real == 0:
            raise ConfigError(f"{type(self.task).__name__}: the eval data is empty; check its split "
                              "or set ClassificationTask.eval_split = None for no evaluation.")
        if totals.get("count") != real:
            raise RunError(f"{type(self.task).__name__}.eval_step returned count={totals.get('count')} for "
                           f"{real:.0f} real examples: weight its sums and count by batch['{masked.MASK}'].")
        count = totals.pop("count")
        return {k: v / count for k, v in totals.items()}

    def _eval_body(self, iterator):
        """One eval step on every replica: the task's sums plus the real example count."""
        def step(batch):
            out = dict(self.task.eval_step(batch))
            out[_REAL] = tf.reduce_sum(tf.cast(batch[masked.MASK], tf.float32))
            return out

        if self.asynchronous:  # parameter_server: inline on the coordinator, reading the ps variables
            return step(next(iterator))
        return self.rep.reduce(self.rep.run(step, self.rep.next_from(iterator)), "sum")


_REAL = "_real_examples"


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every
