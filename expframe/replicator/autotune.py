"""Choices made by measuring this machine once: the fastest of a few candidates, cached.

`run_experiment.precision = 'auto'` and `Replicator.jit_compile = 'auto'` (on the
targets where it is measured) ask a question whose answer depends on the hardware,
not on its name: whether bfloat16 is faster than float32 on a CPU is not told by its
flags (an AVX512_BF16 Xeon ran ResNet-50 at 0.74x in bfloat16). So the answer is
measured: on first use, a small probe (`expframe/replicator/probes.py`) is timed
for every candidate on the target's devices, a few seconds at most, and the choice
is cached per question and what decides its outcome (the CPU's model and the flags
that change its arithmetic, such as avx512_bf16 and amx_bf16; the GPU's model and
compute capability; the TensorFlow version: `auto_settings.cache_key`) in
`$EXPFRAME_CACHE_DIR`, else `$XDG_CACHE_HOME/expframe`, else `~/.cache/expframe`,
file `measured_choices.json`. Every use logs one line: the choice, the measured
speed ratios, and where it is cached, or why it is not. `EXPFRAME_REMEASURE=1`
measures again (and rewrites the entry); so does deleting the file. A cache that
cannot be read (not JSON) or an entry that is damaged (a choice or a timing missing,
a value of the wrong type) is measured again and rewritten, with a line saying so;
a cache that cannot be written is reported and the run goes on with the measured
choice. A write takes an exclusive lock (`fcntl.flock` on `measured_choices.json.lock`),
reads the file again and adds its entry, so processes measuring at the same time
(the workers of a local cluster, the runs of a study) keep each other's entries.

The rule: candidates come in order of preference (the first is the baseline,
float32 or no XLA); a later candidate replaces the current choice only if it is at
least `MIN_SPEEDUP` times faster, so that noise never flips a choice and a
numerically riskier candidate must pay for itself. Each candidate is timed
`REPEATS` times, interleaved, and its fastest time counts (other work on the
machine only ever adds time). Fastest-of-N does not protect a ratio from a machine
that is busy all through the measurement (measured on 2 cores at load 16: bfloat16
came out 1.19x faster while its matmuls and convolutions were each slower), so a
measurement made while the 1-minute load average is above the number of cores holds
for that run only: it is not cached, the line says so, and the next run measures
again.
"""

import datetime
import fcntl
import json
import math
import os
from typing import Callable, Dict, NamedTuple, Optional, Sequence

from expframe.atomic_files import write_json

CACHE_ENV = "EXPFRAME_CACHE_DIR"
REMEASURE_ENV = "EXPFRAME_REMEASURE"
CACHE_FILE = "measured_choices.json"
LOCK_SUFFIX = ".lock"
MIN_SPEEDUP = 1.05
REPEATS = 5

# A timer answers: how many seconds does one run of the probe take for this candidate?
Timer = Callable[[str], float]


def cache_dir() -> str:
    """Where measured choices are cached (see the module docstring)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "expframe")


class Choice(NamedTuple):
    """A measured choice: the value, each candidate's fastest probe time, and its origin."""

    value: str
    seconds: Dict[str, float]
    measured_now: bool
    path: str
    measured_at: str
    load_average: Optional[float]
    cached: bool = True  # False: measured on a busy machine or not writable, for this run only


def _load(path: str):
    """(entries, problem): the cache's entries, and why it could not be read (or None)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:
        return {}, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    if not isinstance(entries, dict):
        return {}, f"not a JSON object but {type(entries).__name__}"
    return entries, None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _valid(entry, candidates: Sequence[str]) -> bool:
    """Whether a cache entry can be used as it is: a known choice, a positive time for
    the baseline (the first candidate) and for the choice, only known candidates, and a
    numeric load average (or none). Anything else is measured again."""
    if not isinstance(entry, dict) or entry.get("choice") not in candidates:
        return False
    seconds = entry.get("seconds")
    if not isinstance(seconds, dict) or candidates[0] not in seconds or entry["choice"] not in seconds:
        return False
    if not all(c in candidates and _number(v) and v > 0 for c, v in seconds.items()):
        return False
    load = entry.get("load_average")
    return (load is None or _number(load)) and isinstance(entry.get("measured_at", ""), str)


def _store(path: str, key: str, entry: dict) -> Optional[str]:
    """Adds `entry` under `key` to the cache at `path`; returns why it could not (or None).

    Under an exclusive lock on `path + LOCK_SUFFIX`, the file is read again and only
    this key is replaced, so that two processes storing at once keep both entries; the
    file itself is replaced atomically (readers never see half of it).
    """
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries, _ = _load(path)  # unreadable: replaced by this entry alone (the reader logged it)
            entries[key] = entry
            write_json(path, entries, indent=1, make_dirs=True, sort_keys=True)
        finally:
            os.close(fd)  # releases the lock
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def decide(seconds: Dict[str, float], candidates: Sequence[str], min_speedup: float = MIN_SPEEDUP) -> str:
    """The rule (module docstring): the first candidate unless a later one is `min_speedup` times faster."""
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate in seconds and seconds[candidate] * min_speedup < seconds[best]:
            best = candidate
    return best


def measure(candidates: Sequence[str], timer: Timer, repeats: int = REPEATS) -> Dict[str, float]:
    """Each candidate's fastest of `repeats` interleaved timings. A candidate whose probe
    fails (its dtype unsupported on the device, XLA unable to compile) is left out;
    the first (the baseline) must run."""
    times: Dict[str, list] = {c: [] for c in candidates}
    failed = {}
    for r in range(repeats):
        order = list(candidates[r % len(candidates):]) + list(candidates[:r % len(candidates)])
        for candidate in order:
            if candidate in failed:
                continue
            try:
                times[candidate].append(float(timer(candidate)))
            except Exception as e:  # pylint: disable=broad-except  (any failure rules the candidate out)
                if candidate == candidates[0]:
                    raise
                failed[candidate] = e
    return {c: min(t) for c, t in times.items() if t and c not in failed}


def ratios_text(seconds: Dict[str, float], candidates: Sequence[str]) -> str:
    """'mixed_bfloat16 0.74x' for each candidate measured beside the baseline: its speed over the baseline's."""
    base = candidates[0]
    parts = [f"{c} {seconds[base] / seconds[c]:.2f}x" for c in candidates[1:] if c in seconds]
    missing = [c for c in candidates[1:] if c not in seconds]
    text = ", ".join(parts) + f" the speed of {base}" if parts else f"only {base} ran"
    return text + (f" ({', '.join(missing)} failed to run)" if missing and parts else "")


def choose(question: str, key: str, candidates: Sequence[str], make_timer: Callable[[], Timer],
           what: str, directory: Optional[str] = None, remeasure: Optional[bool] = None,
           log: Callable[[str], None] = None, repeats: int = REPEATS,
           load_average: Optional[Callable[[], Optional[float]]] = None) -> Choice:
    """The cached choice for `key`, or a new measurement (cached and returned).

    Args:
      question: the binding answered, for the log line (e.g. "run_experiment.precision").
      key: identifies the answer's validity: question, device model, TF version, ...
      candidates: in order of preference; the first is the baseline.
      make_timer: builds the probe (called only when measuring).
      what: the device and probe, for the log line.
      directory: the cache directory (default `cache_dir()`).
      remeasure: measure even if cached (default: `EXPFRAME_REMEASURE` is set to 1).
      log: where the one line goes (default: stdout).
      repeats: timings per candidate.
      load_average: the 1-minute load average now (default: the machine's).
    """
    log = log or (lambda line: print(line, flush=True))
    path = os.path.join(directory or cache_dir(), CACHE_FILE)
    if remeasure is None:
        remeasure = os.environ.get(REMEASURE_ENV, "") not in ("", "0")
    entries, problem = _load(path)
    if problem:
        log(f"expframe: the measured-choice cache {path} cannot be read ({problem}); measuring again")
    entry = entries.get(key)
    if entry is not None and not _valid(entry, candidates):
        log(f"expframe: the measured-choice cache {path} has a damaged entry for {key!r}; measuring again")
        entry = None
    not_cached = None  # why this choice holds for this run only
    if entry is not None and not remeasure:
        choice = Choice(entry["choice"], entry["seconds"], False, path, entry.get("measured_at", "?"),
                        entry.get("load_average"))
    else:
        seconds = measure(candidates, make_timer(), repeats)
        load = (load_average or _load_average)()
        now = datetime.datetime.now().isoformat(timespec="seconds")
        value = decide(seconds, candidates)
        if load is not None and load > _cores():
            not_cached = (f"the machine is busy (load average {load:.2f} on {_cores()} cores), so this measurement "
                          "holds for this run only; the next run measures again")
        else:
            failure = _store(path, key, {"choice": value, "seconds": seconds, "measured_at": now,
                                         "load_average": load})
            if failure:
                not_cached = f"could not write {path} ({failure}), so the choice holds for this run only"
        choice = Choice(value, seconds, True, path, now, load, not_cached is None)
    load_text = "" if choice.load_average is None else f" at load average {choice.load_average:.2f}"
    when = f"measured now{load_text}" if choice.measured_now else f"measured {choice.measured_at}{load_text}"
    where = (f"cached in {path} ({REMEASURE_ENV}=1 measures again)" if not_cached is None
             else f"not cached: {not_cached}")
    log(f"expframe: {question}='auto' -> {choice.value} on {what}: {ratios_text(choice.seconds, candidates)} "
        f"({when}); {where}")
    return choice


def _load_average() -> Optional[float]:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
