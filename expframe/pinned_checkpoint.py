"""A checkpoint pinned for reading: hard links of its files, so that the trainer's pruning
(`Trainer.max_checkpoints`) may delete it while a reader (the continuous evaluator)
restores it.

A TensorFlow checkpoint `ckpt-N` is its index (`ckpt-N.index`) and its data shards
(`ckpt-N.data-0000i-of-0000K`). Once every one of them has a second name in the pin's
folder, deleting the originals only drops a name: the files' data stays until the pin
is removed. Linking takes microseconds, so the window in which a pruning can spoil a
read shrinks from the whole restore (seconds) to the links; a pruning inside that window
leaves the pin incomplete, which is found (every shard counted) and reported as gone.

Hard links need the pin's folder on the checkpoint's filesystem (it lives in the
model_dir) and a filesystem that has them (local disks, NFS, Lustre; not object stores
such as gs://). Where they cannot be made, `pin` raises `Unpinnable` and the reader
reads the checkpoint in place. No TensorFlow here.

Example:
    pinned = pin(".../checkpoints/ckpt-40", ".../.evaluating")   # None: already deleted
    ... read pinned ...
    release(pinned)
"""

import errno
import glob
import os
import re
from typing import List, Optional

FOLDER = ".evaluating"  # in the model_dir: on the checkpoints' filesystem
_SHARD = re.compile(r"\.data-(\d+)-of-(\d+)$")


class Unpinnable(Exception):
    """Hard links cannot be made here (another filesystem, or one without links)."""


def _complete(files: List[str]) -> bool:
    """Whether `files` hold an index and every data shard it names (`-of-K`)."""
    shards = [_SHARD.search(f) for f in files]
    counts = {int(m.group(2)) for m in shards if m}
    if not any(f.endswith(".index") for f in files) or len(counts) != 1:
        return False
    return {int(m.group(1)) for m in shards if m} == set(range(counts.pop()))


def pin(prefix: str, folder: str) -> Optional[str]:
    """Hard links of the checkpoint `prefix`'s files in `folder`; returns the pinned prefix,
    or None when the checkpoint is gone or incomplete (deleted before or while it was
    pinned: nothing is left in `folder`).

    Raises:
      Unpinnable: this filesystem cannot link there (read `prefix` in place instead).
    """
    if "://" in prefix:
        raise Unpinnable(f"{prefix} is not on a local filesystem")
    os.makedirs(folder, exist_ok=True)
    pinned = os.path.join(folder, os.path.basename(prefix))
    release(pinned)
    made = []
    try:
        for source in sorted(glob.glob(glob.escape(prefix) + ".index") + glob.glob(glob.escape(prefix) + ".data-*")):
            target = os.path.join(folder, os.path.basename(source))
            os.link(source, target)
            made.append(target)
    except FileNotFoundError:  # pruned between the listing and its link
        release(pinned)
        return None
    except OSError as e:
        release(pinned)
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise Unpinnable(f"cannot hard-link {prefix} into {folder} ({e.strerror})") from None
        raise
    if not _complete(made):
        release(pinned)
        return None
    return pinned


def release(pinned: str) -> None:
    """Removes the pin's links (the checkpoint's data goes once no name is left)."""
    for path in glob.glob(glob.escape(pinned) + ".index") + glob.glob(glob.escape(pinned) + ".data-*"):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def release_all(folder: str) -> None:
    """Removes every pin in `folder` (those of an evaluator that was killed) and the folder."""
    if not os.path.isdir(folder):
        return
    for entry in os.listdir(folder):
        try:
            os.remove(os.path.join(folder, entry))
        except (FileNotFoundError, IsADirectoryError):
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass
