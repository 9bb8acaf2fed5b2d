"""Runs a study's runs: each an ordinary `main.py` process in `<root>/<run name>`.

Sequential by default; `parallel=N` keeps N processes going (never more than the
cores), each with `TF_NUM_INTRAOP_THREADS = cores // N` so the runs share the
cores instead of fighting over them. Inter-op threads are left alone: they mostly
wait, and the `cpu` target sizes its own pool for its logical devices
(expframe/replicator/targets.py), which an environment value could not override.

A finished run (its `result.json` written under the same parsed configuration,
`parsed_config.gin`, so an edit inside an included gin file counts) is skipped;
any other starts `main.py` again, which resumes from its checkpoint. A stale run, one
whose `parsed_config.gin` differs from the study's (an edit to a gin file or binding
since it ran), is not started: main.py would refuse to resume it (exit 2). With
`move_stale` it is first moved aside, never deleted, to `<root>/stale/<time>/<name>`
(its logs to `<root>/stale/<time>/logs/`) and then starts afresh. Each attempt's
exit status, last error line and wall time go to `<root>/logs/<name>.json`, its output
to `<root>/logs/<name>.log` (and to this process's stdout, prefixed `[k/N]`). A run
that fails does not stop the others.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from expframe import processes, tf_noise
from expframe.atomic_files import write_json
from expframe.sweep.spec import Run, Study

# The clone's main.py; an installed package (no clone) runs `python -m expframe`, the same program.
MAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "main.py")
if not os.path.isfile(MAIN_PY):
    MAIN_PY = None
LOGS = "logs"
STALE = "stale"   # <root>/stale/<time>/: runs moved aside by move_stale
INTRA_OP_ENV = "TF_NUM_INTRAOP_THREADS"
# absl and TensorFlow log lines ("W1130 09:33:06.19 ...", "WARNING: All log messages ...")
_TF_LOG_LINE = re.compile(r"^([IWEF]\d{4} |WARNING: All log messages before absl)")
_print_lock = threading.Lock()


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def worker_count(parallel: int, cores: int) -> tuple[int, int]:
    """(processes, intra-op threads each) for `parallel` requested runs on `cores`."""
    at_once = max(1, min(parallel, cores))
    return at_once, max(1, cores // at_once)


def command(study: Study, run: Run, root: str, mode: str = "train_and_eval",
            main_py: Optional[str] = MAIN_PY) -> list[str]:
    """The `main.py` command line of one run (no shell; arguments as a list); without a
    main.py (an installed package), `python -m expframe`, the same program."""
    program = [main_py] if main_py else ["-m", "expframe"]
    return ([sys.executable] + program + [f"--gin_file={f}" for f in study.gin_files]
            + [f"--gin_param={p}" for p in study.gin_params + run.gin_params]
            + [f"--model_dir={os.path.join(root, run.name)}", f"--mode={mode}"])


def config_digest(text: str) -> str:
    """SHA-256 (hex) of a parsed configuration as main.py writes it to parsed_config.gin
    (UTF-8): what `sha256sum parsed_config.gin` prints, so the Slurm script compares too."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stored_config_digest(model_dir: str) -> Optional[str]:
    """`config_digest` of the run's parsed_config.gin, or None if it has none."""
    try:
        with open(os.path.join(model_dir, "parsed_config.gin"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def is_stale(model_dir: str, parsed_config: Optional[str]) -> bool:
    """Whether model_dir holds a run of another configuration: its parsed_config.gin
    exists and differs from parsed_config (None: nothing to compare, never stale)."""
    stored = stored_config_digest(model_dir)
    return parsed_config is not None and stored is not None and stored != config_digest(parsed_config)


def is_finished(model_dir: str, parsed_config: Optional[str]) -> bool:
    """Whether the run wrote its result.json, under parsed_config (the text of its
    parsed_config.gin) if one is given."""
    if not os.path.isfile(os.path.join(model_dir, "result.json")):
        return False
    return parsed_config is None or stored_config_digest(model_dir) == config_digest(parsed_config)


def move_aside(root: str, names: Sequence[str]) -> str:
    """Moves runs `names` (their directories and logs) to a new `<root>/stale/<time>/`,
    laid out as a study root; deletes nothing. Returns that directory."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    destination, n = os.path.join(root, STALE, stamp), 1
    while os.path.exists(destination):
        n += 1
        destination = os.path.join(root, STALE, f"{stamp}-{n}")
    os.makedirs(os.path.join(destination, LOGS))
    for name in names:
        if os.path.isdir(os.path.join(root, name)):
            os.rename(os.path.join(root, name), os.path.join(destination, name))
        for log in (f"{name}.json", f"{name}.log"):
            if os.path.exists(os.path.join(root, LOGS, log)):
                os.rename(os.path.join(root, LOGS, log), os.path.join(destination, LOGS, log))
    return destination


def last_error(lines: Sequence[str]) -> str:
    """The line that says why a run failed: its last `error: ...` line (main.py's
    format), else the last line that is not a TensorFlow log line."""
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: "):].strip()
    for line in reversed(lines):
        if line.strip() and not _TF_LOG_LINE.match(line):
            return line.strip()
    return ""


def read_record(root: str, name: str) -> dict:
    """The run's attempts so far: {"name", "attempts": [{"started", "exit_code", ...}]}."""
    try:
        with open(os.path.join(root, LOGS, f"{name}.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"name": name, "attempts": []}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


class _Attempt:
    """One main.py process: its output goes to the run's log and, prefixed, to stdout."""

    def __init__(self, owner: processes.Owner, run: Run, argv: list[str], env: Mapping[str, str], root: str,
                 label: str, echo: bool):
        self.owner, self.run, self.root, self.label, self.echo = owner, run, root, label, echo
        self.lines: list[str] = []
        self.stopped_by: Optional[int] = None  # the signal this study forwarded to it
        self.started_at = time.time()
        self.log = open(os.path.join(root, LOGS, f"{run.name}.log"), "a", encoding="utf-8")  # pylint: disable=consider-using-with
        self.log.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')}: {' '.join(argv)}\n")
        self.log.flush()
        # Its own session (processes.Owner): a Ctrl-C reaches this process only, which
        # forwards it once (main.py takes a second signal as "stop now, no checkpoint").
        self.child = owner.start(argv, run.name, env=env, on_line=self._on_line)

    def _on_line(self, child: processes.Child, raw: bytes) -> None:  # pylint: disable=unused-argument
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        self.lines = self.lines[-200:] + [line]
        self.log.write(line + "\n")
        self.log.flush()
        if self.echo and not _TF_LOG_LINE.match(line) and not tf_noise.is_noise(line):
            _say(f"{self.label} {line}")

    def has_started_training(self) -> bool:
        """Whether the run is past its set-up: it wrote config.gin (main.py does so once
        the data and model are built) or a metric, or it has ended."""
        model_dir = os.path.join(self.root, self.run.name)
        for name in ("config.gin", "metrics.jsonl"):
            try:
                if os.path.getmtime(os.path.join(model_dir, name)) >= self.started_at - 1.0:  # coarse clocks
                    return True
            except OSError:
                pass
        return self.child.poll() is not None

    def signal(self, signum: int) -> None:
        self.stopped_by = self.stopped_by or signum
        self.child.signal(signum)

    def finish(self) -> dict:
        """Waits for the process (and whatever it left in its group); appends this
        attempt to the run's record; returns it."""
        code = self.owner.reap(self.child)
        self.log.close()
        error = last_error(self.lines) if code > 0 else ""
        if code < 0:
            error = f"killed by {_signal_name(-code)}"
        attempt = {"started": datetime.datetime.fromtimestamp(self.started_at).isoformat(timespec="seconds"),
                   "exit_code": code, "wall_time_s": round(time.time() - self.started_at, 1), "error": error}
        if self.stopped_by:
            attempt["stopped_by"] = _signal_name(self.stopped_by)
        record = read_record(self.root, self.run.name)
        record["attempts"].append(attempt)
        write_json(os.path.join(self.root, LOGS, f"{self.run.name}.json"), record)
        return attempt


def run_study(study: Study, root: str, config_texts: Optional[Mapping[str, str]] = None, parallel: int = 1,
              mode: str = "train_and_eval", echo: bool = True,
              on_change: Optional[Callable[[], None]] = None, main_py: Optional[str] = MAIN_PY,
              move_stale: bool = False) -> dict:
    """Runs every unfinished run of the study; returns {run name: last attempt or None}.

    Args:
      study: the study.
      root: the study's root directory; run `r` writes into `<root>/<r.name>`.
      config_texts: run name -> expected parsed_config.gin text (from
        `spec.validate`): a run counts as finished only if its parsed_config.gin
        matches. None: any result.json.
      parallel: runs at once, capped at the available cores.
      mode: main.py's --mode.
      echo: copy the runs' output to stdout, prefixed with `[k/N]`.
      on_change: called after each run ends (e.g. to rewrite the summary).
      main_py: the program each run starts (main.py; tests pass a fake).
      move_stale: move stale runs (parsed_config.gin not the one in config_texts)
        aside (`move_aside`) and start them afresh; False: leave them, not started.

    Returns:
      name -> the attempt made now ({"exit_code", "error", "wall_time_s", ...}), or
      None for a run skipped as finished, stale, or not started (stopped by a signal).
    """
    runs = study.runs()
    os.makedirs(os.path.join(root, LOGS), exist_ok=True)
    outcome = {run.name: None for run in runs}
    todo, stale = [], []
    for run in runs:
        text = None if config_texts is None else config_texts.get(run.name)
        model_dir = os.path.join(root, run.name)
        if is_stale(model_dir, text):
            stale.append(run)
            if move_stale:
                todo.append(run)
        elif is_finished(model_dir, text if config_texts is not None else None):
            _say(f"[{run.index + 1}/{len(runs)}] {run.name}: finished, skipped")
        else:
            todo.append(run)
    if stale and move_stale:
        moved_to = move_aside(root, [run.name for run in stale])
        for run in stale:
            _say(f"[{run.index + 1}/{len(runs)}] {run.name}: stale (its parsed_config.gin is not this study's "
                 f"configuration); moved to {os.path.join(moved_to, run.name)}, starting afresh")
    for run in ([] if move_stale else stale):
        _say(f"[{run.index + 1}/{len(runs)}] {run.name}: stale, not started: its parsed_config.gin is not this "
             f"study's configuration (a gin file or binding changed since it ran), so main.py would refuse to "
             f"resume it; rerun with --move_stale to move the old run aside and start afresh")
    at_once, threads = worker_count(parallel, available_cores())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if parallel > 1:
        env.setdefault(INTRA_OP_ENV, str(threads))
        if parallel > at_once:
            _say(f"--parallel={parallel} capped at {at_once}: this machine has {available_cores()} core(s)")
    if todo:
        _say(f"study '{study.name}': {len(todo)} of {len(runs)} run(s) to do, {at_once} at a time"
             + (f", {env[INTRA_OP_ENV]} intra-op thread(s) each" if parallel > 1 else "") + f"; logs in "
             f"{os.path.join(root, LOGS)}")
    received: list[int] = []
    running: list[_Attempt] = []
    owner = processes.Owner("expframe.sweep")

    def on_signal(signum, frame):  # pylint: disable=unused-argument
        received.append(signum)
        for attempt in running:  # main.py saves a checkpoint and exits 0; a second signal kills.
            attempt.signal(signum if len(received) == 1 else signal.SIGKILL)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # With several at once, the first run starts alone until it is set up, so that
        # whatever runs prepare on first use (a generated dataset) is prepared once.
        first = None
        while (todo and not received) or running:
            gate_open = first is None or first.has_started_training()
            while todo and not received and len(running) < at_once and gate_open:
                run = todo.pop(0)
                label = f"[{run.index + 1}/{len(runs)}]"
                _say(f"{label} {run.name}: starting")
                attempt = _Attempt(owner, run, command(study, run, root, mode, main_py), env, root, label, echo)
                running.append(attempt)
                first = first or attempt
                gate_open = at_once == 1 or attempt is not first
            for attempt in [a for a in running if a.child.poll() is not None]:
                running.remove(attempt)
                result = outcome[attempt.run.name] = attempt.finish()
                how = "done" if result["exit_code"] == 0 else f"exit {result['exit_code']}: {result['error']}"
                _say(f"[{attempt.run.index + 1}/{len(runs)}] {attempt.run.name}: {how} "
                     f"({result['wall_time_s']:.0f} s)")
                if on_change:
                    on_change()
            time.sleep(0.1)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for attempt in running:  # only on an exception above: never leave orphans.
            attempt.signal(signal.SIGKILL)
            attempt.finish()
        owner.close(grace_s=1.0)
    if received:
        _say(f"study '{study.name}': stopped by {signal.Signals(received[0]).name}; "
             f"{len(todo)} run(s) not started. Rerun the same command to continue.")
    return outcome
