"""`--mode=continuous_eval`: evaluates a model_dir's checkpoints as a trainer
(`--mode=train`) writes them beside it.

    python main.py --gin_file=EXP --model_dir=DIR --mode=train &
    python main.py --gin_file=EXP --model_dir=DIR --mode=continuous_eval [--eval_timeout_s=3600]

It drives the run's `Evaluator` (the one `train_and_eval` uses, so the numbers equal
`--mode=eval` on the same checkpoint) from checkpoints instead of from the train loop:

- It reads a checkpoint only once the trainer's CheckpointManager has listed it in
  `checkpoints/checkpoint` (TensorFlow writes that index after the checkpoint's files are
  complete), never one still being written.
- It first pins the checkpoint: hard links of its files in `<model_dir>/.evaluating/`
  (`pinned_checkpoint.py`), so the trainer's pruning (`Trainer.max_checkpoints`) can
  delete it meanwhile without disturbing the read. A checkpoint deleted before it was
  pinned, or (where the filesystem has no hard links) while it was read, is skipped with
  one line.
- In step order while it keeps up; once it has fallen behind (a checkpoint was pruned
  before it could be read), it takes the newest checkpoint listed, as
  `tf.train.checkpoints_iterator` does, and names the steps it skipped in one line.
- What it evaluated is remembered in metrics.jsonl: it goes on after the newest eval
  record there, so a restarted evaluator repeats no step.
- It only appends (eval records of the run's evaluations, TensorBoard events, sample
  grids) and keeps the best checkpoint when `Trainer.best_checkpoint` is bound; it holds
  `.evaluator.lock` (one evaluator per model_dir; the trainer then leaves the best
  checkpoint to it).
- It ends after evaluating the final step (`Trainer.train_steps`), or after
  `timeout_s` with no new checkpoint. SIGINT or SIGTERM stops it at once (an evaluation
  under way is dropped, nothing half-written): one line, exit 0; rerunning the same
  command goes on where it stopped.
"""

import os
import signal
import time
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from expframe import dir_lock, evaluator, interrupts, metrics_file, pinned_checkpoint, run_files
from expframe.best_checkpoint import BestCheckpoint
from expframe.checkpointer import read_checkpoint
from expframe.errors import ConfigError, RunError
from expframe.run_files import RunFiles
from expframe.trainer import Trainer


class _Stop(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def listed_checkpoints(checkpoint_dir: str) -> List[Tuple[int, str]]:
    """(step, prefix) of the complete checkpoints in `checkpoint_dir`, oldest first: those its
    index file lists (written after a checkpoint's own files)."""
    state = tf.train.get_checkpoint_state(checkpoint_dir)
    found = []
    for path in [] if state is None else state.all_model_checkpoint_paths:  # joined to checkpoint_dir already
        suffix = path.rsplit("-", 1)[-1]
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(set(found))


def evaluated_steps(metrics_path: str) -> List[int]:
    """The steps metrics.jsonl holds a record of the run's evaluations for (`eval`, or a
    named one: a step's evaluations are appended in one write), in order."""
    return sorted({int(r["step"]) for r in metrics_file.records(metrics_path)
                   if run_files.is_evaluation(str(r.get("split", "")))})


def skipped_steps(last: int, first_new: int, every: int) -> List[int]:
    """The periodic checkpoint steps (multiples of `every`) after the last evaluated step
    and before the first checkpoint there is now: deleted before they could be read."""
    return list(range((last // every + 1) * every, first_new, every))


def _steps(steps: List[int]) -> str:
    shown = ", ".join(map(str, steps[:10]))
    return shown + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")


class ContinuousEvaluator:
    """Evaluates a model_dir's checkpoints as they appear (see the module docstring).

    Args:
      trainer: the prepared Trainer (its task built on a local replicator).
      out: the model_dir's RunFiles (reading: it only appends).
      timeout_s: stop after this long with no new checkpoint.
      poll_s: how often to look for one.
      check_config: called before each evaluation; raises if the model_dir's config
        (written by a trainer that may have started after this evaluator) differs.
    """

    def __init__(self, trainer: Trainer, out: RunFiles, timeout_s: float = 3600.0, poll_s: float = 1.0,
                 check_config: Callable[[], None] = lambda: None):
        if timeout_s <= 0:
            raise ConfigError(f"--eval_timeout_s={timeout_s!r} must be positive (seconds to wait for a new "
                              "checkpoint).")
        self.trainer, self.out = trainer, out
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.check_config = check_config
        self.objects = trainer.evaluation_objects()
        self.pins = os.path.join(out.model_dir, pinned_checkpoint.FOLDER)
        self.best = None
        if trainer.best_checkpoint is not None:
            self.best = BestCheckpoint(out.model_dir, *trainer.best_checkpoint)
        self._critical = False
        self._pending: Optional[int] = None

    # -- signals -------------------------------------------------------------------------

    def _on_signal(self, signum, frame):  # pylint: disable=unused-argument
        if self._critical:  # appending a record: stop right after it
            self._pending = signum
            return
        raise _Stop(signum)

    def _record(self, step: int, results: Dict[str, Dict[str, float]]) -> None:
        """The evaluations' records, outputs and best copy, never cut short by a signal."""
        self._critical = True
        try:
            self.trainer.evaluator.record_all(self.out, step, results)
            metrics = results.get(evaluator.MAIN)
            if self.best is not None and metrics:
                line = self.best.consider(step, metrics, tf.train.Checkpoint(**self.objects))
                if line:
                    self.out.progress(line)
        finally:
            self._critical = False
        if self._pending is not None:
            raise _Stop(self._pending)

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> Dict:
        """Evaluates until the final step, a timeout or a signal; returns the result dict."""
        lock = dir_lock.hold(os.path.join(self.out.model_dir, dir_lock.EVALUATOR))
        if lock is None:
            raise ConfigError(dir_lock.evaluator_held(self.out.model_dir))
        pinned_checkpoint.release_all(self.pins)  # a killed evaluator's
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        interrupts.disarm()  # from here on this loop handles SIGINT
        last_eval, started = {}, time.time()
        try:
            last_eval = self._loop()
        except _Stop as stop:
            done = evaluated_steps(self.out.metrics_path)
            self.out.progress(f"received {signal.Signals(stop.signum).name}: continuous evaluation stopped after "
                              f"step {done[-1] if done else 'none'}; rerun the same command to go on")
            return {"preempted": True, "step": done[-1] if done else 0}
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            pinned_checkpoint.release_all(self.pins)
            lock.release()
        return {"eval": last_eval, "step": int(self.trainer.step.numpy()), "wall_time_s": time.time() - started}

    def _loop(self) -> Dict[str, float]:
        trainer, out = self.trainer, self.out
        done = evaluated_steps(out.metrics_path)
        last, last_eval, behind = (done[-1] if done else 0), {}, False
        if last >= trainer.train_steps:
            out.progress(f"continuous evaluation: step {last} (the final step) is evaluated already")
            return last_eval
        out.progress(f"continuous evaluation of {out.checkpoint_dir}: from step {last + 1}, until step "
                     f"{trainer.train_steps} or {self.timeout_s:.0f} s without a new checkpoint")
        waited_since = time.monotonic()
        while True:
            new = [(step, path) for step, path in listed_checkpoints(out.checkpoint_dir) if step > last]
            if not new:
                if time.monotonic() - waited_since > self.timeout_s:
                    out.progress(f"continuous evaluation: no new checkpoint in {self.timeout_s:.0f} s after "
                                 f"step {last}; stopped")
                    return last_eval
                time.sleep(self.poll_s)
                continue
            lost = skipped_steps(last, new[0][0], trainer.checkpoint_every_steps)
            behind = behind or bool(lost)
            step, path = new[-1] if behind else new[0]  # once behind, the newest (checkpoints_iterator's way)
            passed = sorted(set(lost) | {s for s, _ in new if s < step})
            if passed:
                out.progress(f"continuous evaluation: skipped step(s) {_steps(passed)}: it fell behind the trainer "
                             f"(their checkpoints were pruned by Trainer.max_checkpoints, or newer ones waited); "
                             f"evaluating step {step}, the newest")
            metrics = self._evaluate(step, path)
            if metrics is not None:
                last_eval = metrics
            else:
                behind = True
            last = step
            if step >= trainer.train_steps:
                return last_eval
            waited_since = time.monotonic()

    def _evaluate(self, step: int, path: str) -> Optional[Dict[str, float]]:
        """Pins, restores and evaluates the checkpoint of `step`; None if it is gone."""
        self.check_config()
        try:
            pinned = pinned_checkpoint.pin(path, self.pins)
        except pinned_checkpoint.Unpinnable:
            pinned = path  # read in place: a pruning during the read is found below
        if pinned is None:
            self.out.progress(f"continuous evaluation: skipped step {step}: its checkpoint was deleted by the "
                              "trainer's pruning (Trainer.max_checkpoints) before it was read")
            return None
        try:
            cause = read_checkpoint(self.objects, pinned)
            if cause is not None:
                if not os.path.exists(pinned + ".index"):
                    self.out.progress(f"continuous evaluation: skipped step {step}: its checkpoint was deleted by "
                                      "the trainer's pruning (Trainer.max_checkpoints) while it was read")
                    return None
                raise RunError(f"cannot read the checkpoint {path}: {cause}")
        finally:
            if pinned != path:
                pinned_checkpoint.release(pinned)
        if int(self.trainer.step.numpy()) != step:
            raise RunError(f"the checkpoint {path} holds step {int(self.trainer.step.numpy())}, not {step}.")
        results = self.trainer.evaluator.evaluate_all(step)
        self._record(step, results)
        return results.get(evaluator.MAIN, {})
