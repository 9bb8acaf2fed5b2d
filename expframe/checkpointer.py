"""The run's checkpoints: what is saved (step, the task's trackables, the data position),
where, and the policy for restoring them.

Restore policy: the newest checkpoint that can be read wins; an older one is used
only if every newer one fails to read, with a line saying so. Checkpoints that exist
but none of which can be read are a RunError (exit 1) that names them and the cause:
never a fresh start, and nothing is deleted. On several workers every worker restores
the same step, or the run fails.
"""

import logging
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from expframe.data_position import DataPosition
from expframe.errors import ConfigError, RunError
from expframe.run_files import disk_errors

_PREFIX = "ckpt"  # tf.train.CheckpointManager's: <dir>/ckpt-<step>


class Checkpointer:
    """Saves and restores a run: its step, the task's trackables (models, optimizers,
    ...) and the data position.

    Args:
      replicator: the run's Replicator.
      step: the trainer's step variable.
      trackables: the task's objects to checkpoint (`Task.trackables()`).
      data_position: the run's DataPosition.
      max_to_keep: how many recent checkpoints to keep.
    """

    def __init__(self, replicator, step: tf.Variable, trackables: Dict[str, Any],
                 data_position: DataPosition, max_to_keep: int):
        self._rep = replicator
        self.step = step
        self.data_position = data_position
        self.max_to_keep = max_to_keep
        self.objects = {"step": step, **data_position.in_checkpoint(), **trackables}
        self.checkpoint = tf.train.Checkpoint(**self.objects)  # what the manager saves
        self.manager = None
        self._shared_dir = None

    def restore(self, checkpoint_dir: str, read_dir: Optional[str] = None) -> int:
        """Restores the newest readable checkpoint (see the module docstring); returns its step.

        Checkpoints are written to `checkpoint_dir` and read from `read_dir` (default
        the same): on a multi-worker cluster every worker resumes from the chief's.
        Returns 0 when there is no checkpoint at all.

        Raises:
          RunError: checkpoints exist and none can be read, or the workers cannot
            restore the same step.
          ConfigError: the checkpoint holds another model (a different config).
        """
        self.manager = tf.train.CheckpointManager(self.checkpoint, checkpoint_dir, max_to_keep=self.max_to_keep,
                                                  checkpoint_name=_PREFIX)
        self._shared_dir = read_dir or checkpoint_dir
        candidates = checkpoints_in(self._shared_dir)
        step, failures = self._restore_newest(candidates)
        step = self._agree_across_workers(step, candidates, failures)
        if step:
            self.data_position.restore(self._shared_dir, step)
        return step

    def save(self) -> str:
        """Writes a checkpoint at the current step (the data position is in it).

        A write that fails (a full disk) leaves no part of it behind (TensorFlow's
        `ckpt-N_temp` folder included) and raises a one-line RunError naming the step and
        the last good checkpoint, which is intact."""
        step = int(self.step.numpy())
        last_good = self.manager.latest_checkpoint
        try:
            with disk_errors("the checkpoint", self.manager.directory, step, last_good):
                self.data_position.save(self._shared_dir, step)
                return self.manager.save(checkpoint_number=step)
        except RunError:
            if not (last_good or "").endswith(f"{_PREFIX}-{step}"):  # never the good one of this step
                _remove_unfinished(self.manager.directory, step)
            raise

    # -- the policy ---------------------------------------------------------------------

    def _restore_newest(self, candidates: List[Tuple[int, str]]) -> Tuple[int, List[str]]:
        """Restores the newest readable candidate. Returns (its step, or 0 if there are no
        candidates, or -1 if none could be read; the failures, one text each)."""
        failures = []
        for _, path in candidates:
            cause = self._read(path)
            if cause is None:
                step = int(self.step.numpy())
                if failures:
                    print(f"expframe: could not read the newer checkpoint(s) {'; '.join(failures)}; "
                          f"restored the older {os.path.basename(path)} (step {step}) instead", flush=True)
                return step, failures
            failures.append(f"{os.path.basename(path)} ({cause})")
        return (-1 if candidates else 0), failures

    def _read(self, path: str) -> Optional[str]:
        """Restores `path`; returns None, or why it could not be read (one line)."""
        return read_checkpoint(self.objects, path)

    def _unreadable(self, failures: List[str]) -> RunError:
        return RunError(
            f"cannot read any checkpoint in {self._shared_dir}: {'; '.join(failures)}. Nothing was deleted: "
            "restore the files from a copy, or move them away to start again from step 0.")

    def _agree_across_workers(self, step: int, candidates: List[Tuple[int, str]], failures: List[str]) -> int:
        """The step every worker restored; where they differ, the oldest of their steps,
        restored everywhere. Every worker makes the same `agree` calls in the same order.

        (`Replicator.agree` carries float32: steps are exact below 2**24.)"""
        rep = self._rep
        lowest, highest = rep.agree(step, "min"), rep.agree(step, "max")
        if lowest == highest:
            if step < 0:
                raise self._unreadable(failures)
            return step
        worker = f"worker {rep.worker_index}"
        if lowest <= 0:  # a worker found no checkpoint, or could read none: never train on from a guess
            if step < 0:
                raise self._unreadable(failures)
            if step == 0:
                raise RunError(f"{worker} finds no checkpoint in {self._shared_dir}, but another worker restored "
                               f"step {highest:.0f}: put the checkpoints on a filesystem every worker sees.")
            raise RunError(f"{worker} restored step {step} from {self._shared_dir}, but another worker found no "
                           "readable checkpoint there (see its error).")
        target = int(lowest)
        ok = step == target
        if not ok:
            path = dict(candidates).get(target)
            ok = path is not None and self._read(path) is None and int(self.step.numpy()) == target
        if rep.agree(0.0 if ok else 1.0, "max"):
            raise RunError(f"the workers restored different checkpoints (steps {target} to {highest:.0f}) from "
                           f"{self._shared_dir} and {'another worker' if ok else worker} cannot read step "
                           f"{target}: put the checkpoints on a filesystem every worker sees.")
        if step != target:
            print(f"expframe: {worker} restored step {target}, the newest that every worker reads "
                  f"(it had read step {step})", flush=True)
        return target


def _remove_unfinished(directory: str, step: int) -> None:
    """Removes what a failed save of `step` left (its temporary folder, any part files)."""
    for pattern in (f"{_PREFIX}-{step}_temp*", f"{_PREFIX}-{step}.*"):
        for path in tf.io.gfile.glob(os.path.join(directory, pattern)):
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)


def read_checkpoint(objects: Dict[str, Any], path: str) -> Optional[str]:
    """Restores the checkpoint at `path` (a prefix) into `objects` (the children of a
    checkpoint's root: {"step": ..., "model": ...}); returns None, or why it could not be
    read (one line). Entries of the file that `objects` do not hold (e.g. the data
    position, for an evaluator) are ignored.

    Each read goes through a new `tf.train.Checkpoint` root and `read` (not `restore`):
    a root that is restored into again and again keeps, from a read that failed part-way,
    a queued restoration of its lazily created `save_counter` from the failed file, and
    `restore` creates that variable afterwards and replays every queued restoration, the
    stale one too. A checkpoint deleted while it was read (a trainer's pruning beside a
    continuous evaluator) then made every later read fail on the deleted file
    (tests/test_continuous_eval_race.py).

    Raises:
      ConfigError: the checkpoint holds another model (a different config).
    """
    root = tf.train.Checkpoint(**objects)
    mismatch = shape_mismatches(root, path)
    if mismatch:
        name, saved, now = mismatch[0]
        more = f" (and {len(mismatch) - 1} more variable(s))" if len(mismatch) > 1 else ""
        raise ConfigError(
            f"the checkpoint {path} does not fit this experiment's model: {name} has shape {saved} in the "
            f"checkpoint and {now} in the model{more}; resume with the config it was written with, or use a "
            "new --model_dir.")
    try:
        status = root.read(path)
        status.expect_partial()  # what does not match is reported below, not in warnings at exit
        status.assert_existing_objects_matched()
    except Exception as e:  # noqa: BLE001  (any failure to read is reported, never taken for none)
        text = str(e)
        if "not found in checkpoint" in text or "Unresolved object" in text:
            raise ConfigError(
                f"the checkpoint {path} does not match this experiment's model "
                "(use a new --model_dir, or the config it was written with).") from None
        text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text).strip().splitlines()
        first = text[0] if text else "no message"
        return f"{type(e).__name__}: {first if len(first) <= 160 else first[:157] + '...'}"
    return None


class _FailedReadNotices(logging.Filter):
    """Drops TensorFlow's warnings, at garbage collection, about the values a failed read
    left unrestored: `read_checkpoint` reports that read itself in one line (and every
    read that succeeds says `expect_partial`, so these come only from failed ones)."""

    _NOTICES = ("Value in checkpoint could not be found in the restored object",
                "is being deleted with unrestored values")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(notice in message for notice in self._NOTICES)


logging.getLogger("tensorflow").addFilter(_FailedReadNotices())


def node_paths(view: tf.train.CheckpointView) -> Dict[int, str]:
    """Each node of a checkpoint's object graph -> its path from the root, as the
    checkpoint's keys spell it (`model/layer_with_weights-0/kernel`)."""
    paths, queue = {0: ""}, [0]
    while queue:
        node = queue.pop(0)
        for name, child in view.children(node).items():
            if child not in paths:
                paths[child] = f"{paths[node]}/{name}".lstrip("/")
                queue.append(child)
    return paths


def shape_mismatches(checkpoint: tf.train.Checkpoint, path: str) -> List[Tuple[str, tuple, tuple]]:
    """(variable, shape in the checkpoint, shape now) of every variable of `checkpoint`'s
    objects whose saved value at `path` has another shape: a model changed between the
    run that wrote `path` and this one (model variables first). Read from the checkpoint's
    object graph and shapes only; nothing is restored. Empty if `path` cannot be read
    (restoring it then reports why)."""
    try:
        view = tf.train.CheckpointView(path)
        saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
        paths = node_paths(view)
        matched = view.match(checkpoint)
    except Exception:  # noqa: BLE001  (unreadable: restore() says why)
        return []
    found = []
    for node, obj in matched.items():
        key = f"{paths.get(node, '')}/.ATTRIBUTES/VARIABLE_VALUE"
        shape = getattr(obj, "shape", None)
        if key not in saved or shape is None or not isinstance(obj, tf.Variable) and not hasattr(obj, "assign"):
            continue
        now = tuple(tf.TensorShape(shape).as_list())
        if tuple(saved[key]) != now:
            label = getattr(obj, "path", None) or getattr(obj, "name", None) or paths[node]
            found.append((paths[node], f"'{label}' ({paths[node]})", tuple(saved[key]), now))
    found.sort(key=lambda f: (not f[0].startswith("model"), f[0]))
    return [f[1:] for f in found]


def checkpoints_in(directory: str) -> List[Tuple[int, str]]:
    """(step, path prefix) of every checkpoint in `directory`, newest first.

    Both those that the index file `checkpoint` lists and any `ckpt-<step>.index` on
    disk: a lost or corrupted index must not hide checkpoints (TensorFlow then
    reports none, and the run would silently start again)."""
    paths = set()
    state = tf.train.get_checkpoint_state(directory)
    if state is not None:
        paths.update(os.path.abspath(p) for p in state.all_model_checkpoint_paths)
    for index in tf.io.gfile.glob(os.path.join(directory, f"{_PREFIX}-*.index")):
        paths.add(os.path.abspath(index[:-len(".index")]))
    found = []
    for path in paths:
        suffix = path.rsplit("-", 1)[-1]
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found, reverse=True)
