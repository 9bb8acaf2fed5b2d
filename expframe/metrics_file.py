"""metrics.jsonl, shared by a trainer and a continuous evaluator: whole lines appended
under a short lock, records read, and the file trimmed in place by its trainer.

Two processes append to one model_dir's metrics.jsonl when `--mode=continuous_eval`
runs beside `--mode=train`. Each append takes an exclusive `flock` on the file, writes
its whole lines with one `write` to a descriptor opened with O_APPEND, and lets go: a
reader never sees two records interleaved. A trainer that resumes trims the file
(`rewrite`): under the same lock it writes the kept records to a temporary file and
renames it over the old one; an appender that was waiting for the lock notices that the
name now points at a new file (another inode) and appends there instead, so no record
is lost to the rename. `sync` fsyncs the file (the trainer does it at every checkpoint,
so a power loss cannot leave a gap behind a saved checkpoint).

No TensorFlow here.
"""

import contextlib
import fcntl
import json
import os
from typing import Callable, Dict, Iterator, List

from expframe.atomic_files import write_text


@contextlib.contextmanager
def locked(path: str) -> Iterator[int]:
    """Holds the append lock of `path` (created if missing); yields a descriptor opened for
    appending to the file that `path` names now (not one renamed away meanwhile)."""
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        except BaseException:
            os.close(fd)
            raise
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # trimmed (renamed over) while we waited: append to the new file
    try:
        yield fd
    finally:
        os.close(fd)  # also releases the lock


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append(path: str, records: List[Dict]) -> None:
    """Appends `records`, one JSON object per line, as one write under the lock: all of
    them or none (a write cut short by a full disk is cut back off before the error)."""
    data = "".join(json.dumps(record) + "\n" for record in records).encode("utf-8")
    with locked(path) as fd:
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
        except OSError:
            os.ftruncate(fd, size)
            raise


def sync(path: str) -> None:
    """Flushes `path` to disk (fsync), if it exists."""
    if os.path.exists(path):
        with locked(path) as fd:
            os.fsync(fd)


def read_text(path: str) -> str:
    """The file's text under the lock ('' if it does not exist): whole lines only."""
    if not os.path.exists(path):
        return ""
    with locked(path):
        with open(path, encoding="utf-8") as f:
            return f.read()


def rewrite(path: str, transform: Callable[[str], str]) -> None:
    """Replaces the file's text by `transform(text)`, under the lock, atomically."""
    with locked(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        write_text(path, transform(text))


def records(path: str) -> List[Dict]:
    """The file's JSON records; a line that is not one (a torn last line) is skipped."""
    out = []
    for line in read_text(path).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out
