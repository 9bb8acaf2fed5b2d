"""OS locks on a file in a run's directory: `flock`, which the kernel releases when the
holder dies (SIGKILL included), so a killed holder never leaves a lock behind for the
user to delete by hand (as git's `index.lock` does). The files stay; only a live
holder's lock counts.

- `<model_dir>/.writer.lock`: the one training run that writes the model_dir holds it
  from the end of its validation to its exit; a second trainer is refused with one line
  naming the holder (its pid, host and start time, which the holder writes into the
  file). Readers (eval, continuous_eval, export, plots, summaries) never take it.
- `<model_dir>/.evaluator.lock`: a continuous evaluator holds it while it runs: a second
  one on the same model_dir is refused, and a trainer that evaluates (`train_and_eval`)
  leaves the best checkpoint to it (`is_held`).

On the filesystems runs live on: local filesystems (ext4, xfs, tmpfs) implement flock
between processes of the host; NFS (v4, or v3 with lockd) maps it onto byte-range locks
that the server holds for every client, and releases them when a dead client's lease
expires (tens of seconds); Lustre honours it across nodes only when mounted with
`-o flock` (with `-o localflock` only between processes of one node). No TensorFlow here.

Example:
    lock = dir_lock.hold(os.path.join(model_dir, dir_lock.EVALUATOR))   # None if held
    ...
    lock.release()
"""

import datetime
import fcntl
import os
import socket
import time
from typing import Callable, Optional

from expframe.errors import ConfigError

EVALUATOR = ".evaluator.lock"
WRITER = ".writer.lock"


class Lock:
    """A held lock: its file and descriptor; `holder` is who holds it (pid@host)."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays (it is harmless)
            self._fd = None


def hold(path: str) -> Optional[Lock]:
    """Takes the exclusive lock of `path` (created if missing) without waiting; None when
    another process (or another open of it in this one) holds it. Writes `pid@host` into
    the file for `holder`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:  # a filesystem without flock (Lustre mounted without -o flock)
        os.close(fd)
        raise ConfigError(f"cannot lock {path} ({e.strerror or e}): its filesystem does not support flock (on "
                          "Lustre mount it with -o flock); use a --model_dir on a filesystem that does.") from None
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {since}\n".encode())
    except OSError:  # a full disk: the lock holds all the same (its holder reads 'unknown'); the
        pass         # holder's next write says what is wrong
    return Lock(path, fd)


def hold_waiting(path: str, wait_s: float, say: Callable[[str], None] = print) -> Optional[Lock]:
    """`hold`, retried for up to `wait_s` seconds (a restarted job whose predecessor may
    still be ending), with one line when it starts waiting; None if still held then."""
    deadline = time.monotonic() + wait_s
    lock = hold(path)
    if lock is None and wait_s > 0:
        say(f"expframe: waiting up to {wait_s:.0f} s for {path}, held by {holder(path)}")
    while lock is None and time.monotonic() < deadline:
        time.sleep(0.5)
        lock = hold(path)
    return lock


def is_held(path: str) -> bool:
    """Whether a live process holds the lock of `path` (False when the file is missing).
    Writes nothing: it tries a shared lock on a read-only descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def writer_held(model_dir: str) -> str:
    """The one line refusing a second trainer of `model_dir` (its writer lock is held)."""
    path = os.path.join(model_dir, WRITER)
    return (f"{model_dir} is being trained by another process ({holder(path)}; it holds {path}): one "
            "training run writes a model_dir at a time; wait for it to end, stop it, or use another --model_dir "
            "(--mode=eval and --mode=continuous_eval read it beside the trainer).")


def evaluator_held(model_dir: str) -> str:
    """The one line refusing a second continuous evaluator of `model_dir`."""
    path = os.path.join(model_dir, EVALUATOR)
    return (f"another continuous evaluator ({holder(path)}) is evaluating {model_dir}; stop it first, or "
            "evaluate another --model_dir.")


def writer_wait_s(environ=os.environ) -> float:
    """How long a trainer waits for the writer lock: a restarted job (the launcher's
    restart, a Slurm requeue) waits for its predecessor to finish ending; a run started
    by hand is refused at once."""
    restarted = any(environ.get(name, "0") not in ("", "0")
                    for name in ("EXPFRAME_LAUNCH_RESTARTS", "SLURM_RESTART_COUNT"))
    return 60.0 if restarted else 0.0


def is_chief_by_environment(environ=os.environ) -> bool:
    """Whether this process is the chief of its run as its environment says, read without
    TensorFlow: no cluster at all (`TF_CONFIG` unset, not a Slurm task other than the
    first), TF_CONFIG's `chief` task, or its worker 0 where it names no chief. An
    unreadable TF_CONFIG counts as not the chief (the replicator says why later)."""
    import json  # pylint: disable=import-outside-toplevel
    raw = environ.get("TF_CONFIG")
    if not raw:
        return environ.get("SLURM_PROCID", "0") == "0"
    try:
        config = json.loads(raw)
        task, cluster = config.get("task") or {}, config.get("cluster") or {}
        kind, index = task.get("type"), int(task.get("index", 0))
    except (ValueError, TypeError, AttributeError):
        return False
    return kind == "chief" or (kind == "worker" and index == 0 and "chief" not in cluster)


def holder(path: str) -> str:
    """Who wrote the lock file last (`pid P on host H since T`), or 'unknown'."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"
