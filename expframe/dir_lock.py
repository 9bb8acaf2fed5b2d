"""OS locks on a file in a run's directory: `flock`, which the kernel releases when the
holder dies (SIGKILL included), so a killed holder never leaves a lock behind for the
user to delete by hand (as git's `index.lock` does).

A continuous evaluator holds `<model_dir>/.evaluator.lock` while it runs: a second one
on the same model_dir is refused, and a trainer that evaluates (`train_and_eval`)
leaves the best checkpoint to it (`is_held`). No TensorFlow here.

Example:
    lock = dir_lock.hold(os.path.join(model_dir, dir_lock.EVALUATOR))   # None if held
    ...
    lock.release()
"""

import fcntl
import os
import socket
from typing import Optional

EVALUATOR = ".evaluator.lock"


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
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
    return Lock(path, fd)


def is_held(path: str) -> bool:
    """Whether a live process holds the lock of `path` (False when the file is missing)."""
    if not os.path.exists(path):
        return False
    lock = hold(path)
    if lock is None:
        return True
    lock.release()
    return False


def holder(path: str) -> str:
    """Who wrote the lock file last (`pid@host`), or 'unknown'."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"
