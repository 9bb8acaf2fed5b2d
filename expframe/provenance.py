"""What produced a number: the code's commit, the versions, the machine and its load.

Every run records this (`expframe.run_files.RunFiles.log_provenance`): one record in
`metrics.jsonl` per process start, and the finishing process's in `result.json`;
`python -m expframe.reproduce` puts it beside each result in `docs/results.md`.

    from expframe import provenance
    provenance.record()   # {"commit": ..., "expframe": ..., "tensorflow": ..., "machine": {...}, ...}

No TensorFlow import here: versions are read from the installed distributions, so
the launchers and `expframe.reproduce` can call it cheaply.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Optional

NOT_A_CHECKOUT = "not a git checkout"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(args: list[str], cwd: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit(root: str = _PACKAGE_ROOT) -> tuple[str, bool]:
    """(commit hash, whether the files outside `docs/` differ from it) of the checkout
    that holds the running expframe package; (`NOT_A_CHECKOUT`, False) when that
    directory is not the top of a git work tree (an installed package, e.g. in a virtual
    environment that happens to sit inside some other checkout, is not).

    Dirty means a tracked file changed or a file git does not ignore is untracked: a run
    of a module never committed is not a run of the commit. Files under `docs/` are left
    out (docs change no result, and `python -m expframe.reproduce` writes its page there
    while it runs), and so are ignored ones (`runs/`, `.venv/`)."""
    top = _git(["rev-parse", "--show-toplevel"], root)
    if top is None or os.path.realpath(top) != os.path.realpath(root):
        return NOT_A_CHECKOUT, False
    sha = _git(["rev-parse", "HEAD"], root)
    if not sha:
        return NOT_A_CHECKOUT, False
    status = _git(["status", "--porcelain", "--untracked-files=normal", "--", ".", ":(exclude)docs"], root)
    return sha, bool(status)


def version(distribution: str) -> str:
    """The version of a package (`tensorflow`, `keras`): the imported module's, else the
    installed distribution's, else 'not installed'."""
    module = sys.modules.get(distribution)
    if isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo), else what `platform` knows."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (the first processor's `flags` line of /proc/cpuinfo)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def machine() -> dict:
    """CPU model, cores, whether it has AVX-512 and native bfloat16, the OS, Python."""
    flags = cpu_flags()
    return {"cpu": cpu_name(), "cores": cores(), "avx512": "avx512f" in flags,
            "bf16": bool(flags & {"avx512_bf16", "amx_bf16"}), "platform": platform.platform(),
            "python": platform.python_version()}


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01 ([] where unknown)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def now() -> str:
    """Local date and time with its UTC offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def record() -> dict:
    """Everything above, now: {"time", "commit", "dirty", "expframe", "tensorflow",
    "keras", "machine", "load_average", "argv"}."""
    sha, dirty = commit()
    from expframe import __version__  # pylint: disable=import-outside-toplevel
    return {"time": now(), "commit": sha, "dirty": dirty, "expframe": __version__,
            "tensorflow": version("tensorflow"), "keras": version("keras"), "machine": machine(),
            "load_average": load_average(), "argv": list(sys.argv)}


def finished(started: dict) -> dict:
    """`started` (a `record()`) with the end time and the load average at the end."""
    return dict(started, finished=now(), load_average_end=load_average())
