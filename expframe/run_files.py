"""Everything a run writes into its model_dir (the contract in DESIGN.md, Run outputs).

What 'auto' resolved to (`run_experiment.precision`, `Replicator.jit_compile`: measured
on this machine and cached, so another machine or a changed cache can answer
differently) is recorded in resolved.json; a resume that would resolve them
differently is refused like a change of config.gin (`check_resolved`).

A run's wall time spans its starts (segments: the first start, then one per resume):
each start records its own in segments.json at every checkpoint (`record_segment`),
and result.json sums them (`finish_segment`).

Only the chief writes into the model_dir; other workers get a private temporary
directory that is removed at the end. The one exception: each other worker saves
its own data position (its shard's iterator) under checkpoints/data/ next to the
chief's checkpoints (see Trainer.save). Text files are written atomically
(temporary file + rename), so a crash never leaves half a config or result.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf

from expframe import metrics_file
from expframe.atomic_files import write_json
from expframe.atomic_files import write_text as atomic_write
from expframe.errors import ConfigError, RunError

PROVENANCE = "provenance"  # the split of metrics.jsonl's provenance records
ON_DEMAND = "on_demand"  # the split of `--mode=eval`'s records: apart from the run's eval curves
RESOLVED = "resolved.json"  # what 'auto' resolved to: {binding: value}
SEGMENTS = "segments.json"  # each start's wall time: {"segments": [{"from_step", "to_step", "start", "end"}]}
# Why a recorded choice can resolve differently on resume, by binding (else 'auto').
_RESOLVED_BY = {"Trainer.train_steps": "Trainer.train_epochs", "Trainer.eval_every_steps": "Trainer.eval_every_epochs",
                "Trainer.checkpoint_every_steps": "Trainer.checkpoint_every_epochs"}


def resolved_choices(replicator) -> Dict[str, Any]:
    """What this run computes in, whatever was bound ('auto' included): the Keras
    precision policy in force and whether the Replicator compiles its steps with XLA
    (`Replicator.compiles_steps`; deciding it may measure, once per machine)."""
    return {"run_experiment.precision": keras.mixed_precision.global_policy().name,
            "Replicator.jit_compile": bool(replicator.compiles_steps)}


def check_resolved(model_dir: str, resolved: Dict[str, Any]) -> None:
    """Refuses to resume model_dir with choices other than those it was run with.

    Args:
      model_dir: the run's directory; a run without resolved.json (new, or older than
        it) passes.
      resolved: this run's `resolved_choices`.

    Raises:
      ConfigError: one line naming the binding, the value recorded and the value now,
        and `--allow_config_change`.
    """
    path = os.path.join(model_dir, RESOLVED)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
        if not isinstance(recorded, dict):
            raise ValueError(f"not a JSON object but {type(recorded).__name__}")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({str(e).splitlines()[0][:80]}); delete it to resume with this "
                          "run's choices, or use a new --model_dir.") from None
    for binding, now in resolved.items():
        was = recorded.get(binding, now)
        if was != now and binding in _RESOLVED_BY:
            raise ConfigError(
                f"{path}: {_RESOLVED_BY[binding]} comes to {binding} = {now!r} in this run, but the run in "
                f"{model_dir} was trained with {was!r} (the train data's size changed); bind {binding} = {was!r} in "
                f"its place and pass --allow_config_change to resume as it was trained, pass --allow_config_change "
                f"to go on with {now!r}, or use a new --model_dir.")
        if was != now:
            raise ConfigError(
                f"{path}: {binding} resolves to {now!r} in this run, but the run in {model_dir} was trained with "
                f"{was!r} ('auto' measured differently: another machine, or a changed cache); bind {binding} = "
                f"{was!r} and pass --allow_config_change to resume as it was trained, pass --allow_config_change "
                f"to go on with {now!r}, or use a new --model_dir.")


def is_evaluation(split: str) -> bool:
    """Whether metrics.jsonl's `split` is one of a run's evaluation curves: its own (`eval`)
    or a named evaluation of other data (`eval_<name>`, `Task.named_evals`)."""
    return split == "eval" or split.startswith("eval_")


def check_writable(model_dir: str) -> None:
    """Refuses a model_dir that cannot be written (permissions, a read-only mount, an
    immutable folder): it, or the nearest folder above it that exists, must take a file.
    The probe is an unnamed temporary file (O_TMPFILE): nothing is left behind.

    Raises:
      ConfigError: one line naming the folder and the cause.
    """
    folder = os.path.abspath(model_dir)
    while not os.path.isdir(folder):
        if os.path.exists(folder):
            raise ConfigError(f"--model_dir={model_dir} is a file, not a folder; choose another --model_dir.")
        folder = os.path.dirname(folder)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"--model_dir={model_dir} cannot be written ({e.strerror or e} in {folder}); fix its "
                          "permissions or mount, or choose another --model_dir.") from None


@contextlib.contextmanager
def disk_errors(what: str, path: str, step: int, last_good: Optional[str] = None):
    """Turns a failed write (a full disk, a filesystem gone read-only, quota) into one
    line: a RunError (exit 1) naming what was written, where, at which step, and the
    last good checkpoint."""
    try:
        yield
    except (OSError, tf.errors.OpError) as e:
        text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(getattr(e, "strerror", None) or
                                                            getattr(e, "message", None) or e)).strip().splitlines()
        cause = text[-1] if text else type(e).__name__
        cause = cause if len(cause) <= 160 else "..." + cause[-157:]  # the cause is at the end
        full = getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)
        kept = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
        advice = "free space" if full else "fix the filesystem"
        raise RunError(f"{'no space left on the device' if full else 'cannot write'}: writing {what} of step {step} "
                       f"into {path} failed ({cause}); {kept}; {advice}, then rerun the same command to "
                       "resume.") from None


START_FILES = ("config.gin", "parsed_config.gin", RESOLVED, "metrics.jsonl", ".writer.lock")


def remove_start(model_dir: str) -> None:
    """Removes what the start of a new run wrote into `model_dir` (`START_FILES`, a
    TensorBoard folder without events) and the folder itself if that leaves it empty: a
    start that failed before its first step leaves nothing behind."""
    for name in START_FILES:
        try:
            os.remove(os.path.join(model_dir, name))
        except FileNotFoundError:
            pass
    for entry in (os.listdir(model_dir) if os.path.isdir(model_dir) else []):
        if entry.startswith(".tmp_"):
            os.remove(os.path.join(model_dir, entry))
    try:
        os.rmdir(model_dir)
    except OSError:
        pass


class RunFiles:
    """config.gin, operative_config.gin, metrics.jsonl, TensorBoard, result.json, checkpoints/."""

    def __init__(self, model_dir: str, is_chief: bool = True, worker_index: int = 0):
        self.is_chief = is_chief
        self.model_dir = model_dir if is_chief else tempfile.mkdtemp(prefix=f"expframe_worker{worker_index}_")
        self.checkpoint_dir = os.path.join(self.model_dir, "checkpoints")
        # Every worker resumes from the chief's checkpoints (a filesystem all workers see).
        self.shared_dir = model_dir
        self.restore_dir = os.path.join(model_dir, "checkpoints")
        self.metrics_path = os.path.join(self.model_dir, "metrics.jsonl")
        self.last_good: Optional[str] = None  # the newest checkpoint written, for messages
        self._writers = {}
        self._segments: List[Dict[str, float]] = []  # the earlier starts' (segments.json)
        self._segment: Optional[Dict[str, float]] = None  # this start's

    @staticmethod
    def existing_config(model_dir: str, name: str = "config.gin"):
        """The text of model_dir/name (config.gin or parsed_config.gin), or None."""
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()

    def start(self, config_text: str, resumed_step: int, parsed_config: str = None,
              resolved: Optional[Dict[str, Any]] = None, own_eval: bool = True) -> None:
        """The trainer's start: creates the model_dir, writes config.gin (as given),
        parsed_config.gin (what it parses to: includes expanded, paths gone; what a
        resume compares) and resolved.json (`resolved`: what 'auto' resolved to, see
        `check_resolved`), and trims metrics.jsonl past the resumed step: its train and
        provenance records, and its eval records when this trainer evaluates
        (`own_eval`); the eval records of a continuous evaluator are kept."""
        self._metrics_up_to(resumed_step, own_eval, self._metrics_text())  # refuses a bad file before writing
        with disk_errors("the run's files", self.model_dir, resumed_step, self.last_good):  # each whole or not at all
            os.makedirs(self.model_dir, exist_ok=True)
            atomic_write(os.path.join(self.model_dir, "config.gin"), config_text)
            if parsed_config is not None:
                atomic_write(os.path.join(self.model_dir, "parsed_config.gin"), parsed_config)
            if resolved is not None:
                write_json(os.path.join(self.model_dir, RESOLVED), resolved)
            if os.path.exists(self.metrics_path):
                metrics_file.rewrite(self.metrics_path,
                                     lambda text: self._metrics_up_to(resumed_step, own_eval, text, quiet=True))
        self._segments = self._earlier_segments() if resumed_step else []
        self._segment = {"from_step": int(resumed_step), "to_step": int(resumed_step), "start": time.time(),
                         "end": time.time()}

    def _earlier_segments(self) -> List[Dict[str, float]]:
        """The segments of the earlier starts (segments.json), [] if none were recorded or
        the file cannot be read (it holds timings only: a run never fails on it)."""
        try:
            with open(os.path.join(self.model_dir, SEGMENTS), encoding="utf-8") as f:
                segments = json.load(f)["segments"]
            return [{"from_step": int(s["from_step"]), "to_step": int(s["to_step"]), "start": float(s["start"]),
                     "end": float(s["end"])} for s in segments]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def record_segment(self, step: int) -> None:
        """This start's segment (from its start to now, at `step`), written beside the
        earlier ones into segments.json: called at every checkpoint, so a resume finds
        the time each earlier start spent up to its last checkpoint."""
        if self._segment is None:
            return
        self._segment.update(to_step=int(step), end=time.time())
        if self.is_chief:
            with disk_errors("segments.json", self.model_dir, step, self.last_good):
                write_json(os.path.join(self.model_dir, SEGMENTS), {"segments": self._segments + [self._segment]})

    def finish_segment(self, step: int) -> Dict[str, float]:
        """Ends this start's segment at `step` (recorded as `record_segment` does) and returns
        result.json's wall times, in seconds:

          wall_time_s: the sum of the segments, each from its start (after the build and
            the restore: when it begins to write) to its last checkpoint, the last one to
            now (the time a killed start spent past its last checkpoint is not counted);
          wall_time_first_start_to_end_s: from the first segment's start to now, the
            pauses between segments included;
          wall_time_last_segment_s: this start's segment alone.
        """
        self.record_segment(step)
        this = self._segment or {"start": time.time(), "end": time.time()}
        first = self._segments[0]["start"] if self._segments else this["start"]
        last = this["end"] - this["start"]
        return {"wall_time_s": round(sum(s["end"] - s["start"] for s in self._segments) + last, 3),
                "wall_time_first_start_to_end_s": round(this["end"] - first, 3),
                "wall_time_last_segment_s": round(last, 3), "segments": len(self._segments) + 1}

    def start_reading(self) -> None:
        """An evaluator's start (eval, continuous_eval): it only appends to metrics.jsonl
        and TensorBoard and never rewrites a file the trainer writes. The model_dir may
        not exist yet (an evaluator started before its trainer)."""
        os.makedirs(self.model_dir, exist_ok=True)

    def _metrics_text(self) -> Optional[str]:
        return metrics_file.read_text(self.metrics_path) if os.path.exists(self.metrics_path) else None

    def _metrics_up_to(self, step: int, own_eval: bool, text: Optional[str], quiet: bool = False) -> Optional[str]:
        """metrics.jsonl's `text` without the records a resumed trainer will write again
        (None if there is no file): those past `step` but another process's eval records
        (see `start`). A run killed after its last checkpoint logged steps it now redoes.

        A crash while a record was appended leaves a torn last line: it is dropped,
        with a line saying so. Any other line that is not a record is a RunError.
        """
        if text is None:
            return None
        lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        kept = []
        for number, line in lines:
            try:
                record = json.loads(line)
                record_step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                if number == lines[-1][0]:
                    if not quiet:
                        self.progress(f"expframe: dropped the torn last line {number} of {self.metrics_path} "
                                      f"(a crash while writing it): {line[:60]!r}")
                    continue
                raise RunError(f"{self.metrics_path} line {number} is not a JSON metrics record "
                               f"({line[:60]!r}); fix or delete that line, then rerun.") from None
            split = str(record.get("split", ""))
            if record_step <= step or split == ON_DEMAND or (is_evaluation(split) and not own_eval):
                kept.append(line + "\n")
        return "".join(kept)

    def write_operative_config(self, text: str, step: int = 0) -> None:
        with disk_errors("operative_config.gin", self.model_dir, step, self.last_good):
            atomic_write(os.path.join(self.model_dir, "operative_config.gin"), text)

    def log_metrics(self, step: int, split: str, metrics: Dict[str, float]) -> None:
        """One record of `split` at `step`: metrics.jsonl and TensorBoard (`<model_dir>/<split>/`)."""
        self.log_evaluations(step, {split: metrics})

    def log_evaluations(self, step: int, by_split: Dict[str, Dict[str, float]]) -> None:
        """A record per split at `step`, appended to metrics.jsonl together (one write: a
        crash never leaves some of a step's evaluations recorded and not the others),
        then each split's TensorBoard scalars in its own folder."""
        if not self.is_chief:
            return
        records = [{"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()}}
                   for split, metrics in by_split.items()]
        with disk_errors("the metrics", self.metrics_path, step, self.last_good):
            metrics_file.append(self.metrics_path, records)
        for split, metrics in by_split.items():
            self._scalars(split, step, metrics)

    def log_on_demand(self, step: int, checkpoint: str, by_evaluation: Dict[str, Dict[str, float]]) -> None:
        """`--mode=eval`'s records, apart from the run's curves: one per evaluation, with
        `"split": "on_demand"`, `"evaluation"` (its name: `eval` or `eval_<name>`) and
        `"checkpoint"` (as --checkpoint named it), in metrics.jsonl; in TensorBoard under
        `on_demand/`, tagged `<evaluation>/<metric>`. Evaluating a step again adds a record
        and replaces none."""
        if not self.is_chief:
            return
        records = [{"step": int(step), "split": ON_DEMAND, "evaluation": name, "checkpoint": str(checkpoint),
                    **{k: float(v) for k, v in metrics.items()}} for name, metrics in by_evaluation.items()]
        with disk_errors("the metrics", self.metrics_path, step, self.last_good):
            metrics_file.append(self.metrics_path, records)
        for name, metrics in by_evaluation.items():
            self._scalars(ON_DEMAND, step, {f"{name}/{k}": v for k, v in metrics.items()})

    def _scalars(self, folder: str, step: int, metrics: Dict[str, float]) -> None:
        with disk_errors("the TensorBoard events", os.path.join(self.model_dir, folder), step, self.last_good):
            writer = self._writers.get(folder)
            if writer is None:
                writer = self._writers[folder] = tf.summary.create_file_writer(os.path.join(self.model_dir, folder))
            with writer.as_default(step=int(step)):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
            writer.flush()

    def log_provenance(self, step: int, record: Dict) -> None:
        """Appends `{"step": step, "split": "provenance", ...record}` to metrics.jsonl: what
        this process runs (commit, versions, machine, load; `expframe.provenance`). One per
        process start, so a resumed run has one per start, each at the step it resumed
        from. Readers of metrics take splits by name ("train", "eval") and skip this one;
        it is not a TensorBoard scalar."""
        if not self.is_chief:
            return
        with disk_errors("the provenance record", self.metrics_path, step, self.last_good):
            metrics_file.append(self.metrics_path, [{"step": int(step), "split": PROVENANCE, **record}])

    def sync_metrics(self, step: int) -> None:
        """fsyncs metrics.jsonl (at every checkpoint: no gap behind a saved checkpoint)."""
        if self.is_chief:
            with disk_errors("the metrics", self.metrics_path, step, self.last_good):
                metrics_file.sync(self.metrics_path)

    def progress(self, line: str) -> None:
        if self.is_chief:
            print(line, flush=True)

    def write_result(self, result: Dict) -> None:
        if self.is_chief:
            with disk_errors("result.json", self.model_dir, result.get("step", 0), self.last_good):
                write_json(os.path.join(self.model_dir, "result.json"), result)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        if not self.is_chief:
            shutil.rmtree(self.model_dir, ignore_errors=True)
