"""Runs one registered result and writes its record, `<work>/records/<name>.json`.

Experiments and studies run through the sweep runner (`expframe.sweep.runner`): one
ordinary `main.py` run per seed or study point, in `<work>/<name>/<run name>`, skipped
when finished under the same parsed configuration and resumed from its checkpoint
when not. Benchmarks run as their own scripts, writing JSON into `<work>/<name>/`.

A record holds the numbers, the exact commands, what ran them (`expframe.provenance`:
commit, versions, machine), the load average at the start and the end, the CPU that
other processes used meanwhile, the wall time and the dates. It is written when the
result is complete; a result whose record matches its configuration is skipped, so
rerunning the same `python -m expframe.reproduce` command continues where it stopped.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import resource
import shlex
import sys
import time
from typing import Optional

from expframe import processes, provenance
from expframe.atomic_files import write_json
from expframe.reproduce import kept, registry, spread
from expframe.sweep import naming, runner, spec, summary

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = "records"
STALE = "stale"  # runs made under another configuration, kept for reference


class Stopped(Exception):
    """The runs were stopped by a signal (each saved a checkpoint); nothing is recorded."""


def say(line: str) -> None:
    print(f"reproduce: {line}", flush=True)


def shown(argv: list[str]) -> str:
    """A command as a reader types it: `python`, paths relative to the repository."""
    words = []
    for i, word in enumerate(argv):
        if i == 0 and word == sys.executable:
            word = "python"
        elif os.path.isabs(word) and word.startswith(REPO + os.sep):
            word = os.path.relpath(word, REPO)
        elif "=" in word and word.startswith("--") and REPO + os.sep in word:
            flag, value = word.split("=", 1)
            word = f"{flag}={os.path.relpath(value, REPO) if value.startswith(REPO + os.sep) else value}"
        words.append(word)
    return shlex.join(words)


def record_path(work: str, name: str) -> str:
    return os.path.join(work, RECORDS, f"{name}.json")


def sittings_path(work: str, name: str) -> str:
    """The sittings of a result not yet complete: each invocation that ran it and stopped."""
    return os.path.join(work, RECORDS, f"{name}.sittings.json")


def read_sittings(work: str, name: str, sig: Optional[str] = None) -> list[dict]:
    """The earlier sittings of a result (those made under signature `sig`, when given)."""
    try:
        with open(sittings_path(work, name), encoding="utf-8") as f:
            sittings = json.load(f)
    except (OSError, ValueError):
        return []
    return [s for s in sittings if isinstance(s, dict) and (sig is None or s.get("signature") == sig)]


def read_record(work: str, name: str) -> Optional[dict]:
    try:
        with open(record_path(work, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# -- the machine while a result runs --------------------------------------------------------------

def _busy_cpu_s() -> Optional[float]:
    """CPU seconds all processes of the machine have used since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Meter:
    """Wall time, and the cores that processes other than this one and its children used."""

    def __init__(self):
        self.started_at, self.busy, self.own = time.time(), _busy_cpu_s(), _own_cpu_s()

    def other_cores(self) -> Optional[float]:
        busy = _busy_cpu_s()
        if busy is None or self.busy is None:
            return None
        wall = max(time.time() - self.started_at, 1e-6)
        return round(max(0.0, (busy - self.busy) - (_own_cpu_s() - self.own)) / wall, 2)


def settle(limit_s: float, below: float = 1.0) -> list[float]:
    """Waits until the 1-minute load average is under `below` (it still counts the runs
    just ended) or `limit_s` passed; returns the load average then."""
    deadline, said = time.time() + limit_s, False
    while True:
        load = provenance.load_average()
        if not load or load[0] < below or time.time() >= deadline:
            return load
        if not said:
            say(f"load average {load[0]:.2f}: waiting up to {limit_s:.0f} s for it to fall under {below:g} "
                "before recording it")
            said = True
        time.sleep(5)


# -- experiments and studies, through the sweep runner --------------------------------------------

def experiment_study(result: registry.Experiment, quick: bool) -> spec.Study:
    """The experiment as a study of its seeds: one main.py run each (--set=quick: the first seed only)."""
    chosen = result.seeds[:1] if quick else result.seeds
    seeds = spec.Axis(("run_experiment.seed",), tuple((str(s),) for s in chosen), f"registry '{result.name}'")
    return spec.Study(result.name, list(result.gin_files), list(result.params(quick)), [seeds])


def study_of(result: registry.StudyResult, quick: bool) -> spec.Study:
    if not quick:
        return spec.build_study(result.study_file, name=result.name)
    return spec.build_study(result.study_file, gin_params=result.quick_params, sweeps=result.quick_sweeps,
                            zips=result.quick_zips, name=result.name)


def _run_rows(study: spec.Study, root: str) -> list[dict]:
    rows = summary.collect(study, root)
    for row in rows:
        model_dir = os.path.join(root, row["run"])
        result = summary._read_json(os.path.join(model_dir, "result.json")) or {}  # pylint: disable=protected-access
        row["final"] = result.get("eval", {})
        row["provenance"] = result.get("provenance")
        records = summary.read_metrics(model_dir)
        row["evals"] = [_numbers(r) for r in records if r.get("split") == "eval"]
        train = [r for r in records if r.get("split") == "train"]
        row["train_last"] = _numbers(train[-1]) if train else {}
        row["model_dir"] = model_dir
        row["values"] = {k: row[k] for k in study.keys().values()}
    return rows


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k == "step" or (isinstance(v, (int, float)) and not isinstance(v, bool))}


def _baseline(result: registry.Experiment, study: spec.Study, root: str, quick: bool) -> dict:
    """Seed -> the eval metrics of the untrained model, from `expframe.reproduce.baseline`."""
    out = {}
    for run in study.runs():
        path = os.path.join(root, run.name, "initial_eval.json")
        argv = ([sys.executable, "-m", "expframe.reproduce.baseline", f"--out={path}"]
                + [f"--gin_file={f}" for f in study.gin_files]
                + [f"--gin_param={p}" for p in study.gin_params + run.gin_params])
        if not os.path.isfile(path):
            say(f"{result.name}: evaluating the untrained model ({run.name})")
            code = processes.run(argv, f"baseline {run.name}", cwd=REPO,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"), capture=False).returncode
            if code != 0:
                raise RuntimeError(f"{shown(argv)} exited {code}")
        with open(path, encoding="utf-8") as f:
            out[run.name] = dict(json.load(f), command=shown(argv))
    return out


def set_aside_stale(study: spec.Study, root: str, texts: dict[str, str]) -> list[str]:
    """Moves each run made under another configuration (its parsed_config.gin differs, e.g.
    a gin file was edited since) to `<root>/stale/<run>.<time>/`, with its logs, so that it
    runs again from scratch instead of being refused as a changed resume. Deletes nothing."""
    moved = []
    for run in study.runs():
        model_dir = os.path.join(root, run.name)
        try:
            with open(os.path.join(model_dir, "parsed_config.gin"), encoding="utf-8") as f:
                previous = f.read()
        except OSError:
            continue
        if previous == texts[run.name]:
            continue
        dest = os.path.join(root, STALE, f"{run.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(os.path.join(dest, runner.LOGS), exist_ok=True)
        os.replace(model_dir, os.path.join(dest, "model_dir"))
        for suffix in (".json", ".log"):
            log = os.path.join(root, runner.LOGS, run.name + suffix)
            if os.path.exists(log):
                os.replace(log, os.path.join(dest, runner.LOGS, run.name + suffix))
        say(f"{run.name}: made under another configuration; moved to {dest}, running it again")
        moved.append(dest)
    return moved


def run_sweep(study: spec.Study, root: str, parallel: int,
              kept_dir: Optional[str] = None) -> tuple[list[dict], dict[str, str]]:
    """Runs (or resumes) the study's main.py runs; returns (rows, run name -> command).
    With `kept_dir` (`kept.folder`), runs finished in another checkout are restored from
    it first, and each run finished here is kept there as it finishes."""
    texts = spec.validate(study)
    os.makedirs(root, exist_ok=True)
    set_aside_stale(study, root, texts)
    if kept_dir:
        for name in kept.set_aside_stale(study, kept_dir, texts):
            say(f"{name}: the run kept in {kept_dir} is of an earlier configuration; moved to {kept.STALE}/")
        for name in kept.restore(study, root, kept_dir, texts):
            say(f"{name}: finished in an earlier sitting; restored from {kept_dir}")

    def on_change():
        summary.write_summary(study, root)
        if kept_dir:
            kept.keep(study, root, kept_dir, texts)
    runner.run_study(study, root, texts, parallel=parallel, on_change=on_change)
    on_change()
    commands = {run.name: shown(runner.command(study, run, root)) for run in study.runs()}
    return _run_rows(study, root), commands


def keep_finished(result, work: str, quick: bool, kept_dir: str) -> list[str]:
    """Keeps the runs of `result` finished in the work directory beside the page
    (`--page_only`: e.g. runs started by hand with the study's exact commands)."""
    study = study_for(result, quick)
    texts = spec.validate(study)
    kept.set_aside_stale(study, kept_dir, texts)
    return kept.keep(study, os.path.join(work, result.name), kept_dir, texts)


# -- benchmarks -------------------------------------------------------------------------------------

def run_benchmark(result: registry.Benchmark, root: str, quick: bool) -> tuple[dict, str]:
    """Runs the script unless its JSON is there; returns (its JSON, the command).

    The script writes `<name>.running.json` (some write after each configuration), renamed
    to `<name>.json` once it exits 0: a run stopped half-way is run again, not reused."""
    out = os.path.join(root, f"{result.name}.json")
    running_out = os.path.join(root, f"{result.name}.running.json")
    argv = [sys.executable, os.path.join(REPO, result.script), *result.argv(quick), f"--out={running_out}"]
    made_by = os.path.join(root, f"{result.name}.made_by")
    by = _made_by(result, argv)
    if os.path.isfile(out) and _read(made_by) != by:
        # A finished JSON of another script or command (edited since, or other arguments):
        # its numbers are not this benchmark's; run it again.
        os.remove(out)
    if not os.path.isfile(out):
        os.makedirs(root, exist_ok=True)
        log = os.path.join(root, f"{result.name}.log")
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"=== {provenance.now()}: {shown(argv)}\n")
        with open(log, "a", encoding="utf-8") as f:
            def on_line(child, raw: bytes) -> None:  # pylint: disable=unused-argument
                line = raw.decode("utf-8", errors="replace")
                f.write(line)
                if not runner._TF_LOG_LINE.match(line):  # pylint: disable=protected-access
                    print(f"[{result.name}] {line}", end="" if line.endswith("\n") else "\n", flush=True)

            code = processes.run(argv, result.name, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                 on_line=on_line).returncode
        if code != 0:
            raise RuntimeError(f"{shown(argv)} exited {code}; its output is in {log}")
        with open(made_by, "w", encoding="utf-8") as f:
            f.write(by)
        os.replace(running_out, out)
    else:
        say(f"{result.name}: reusing its finished output {out} (written {_mtime(out)} by the same command and "
            f"commit); delete it to measure again")
    with open(out, encoding="utf-8") as f:
        return json.load(f), shown(argv)


def _mtime(path: str) -> str:
    """When `path` was last written, as provenance.now() writes times."""
    return datetime.datetime.fromtimestamp(os.path.getmtime(path)).astimezone().isoformat(timespec="seconds")


def _made_by(result: registry.Benchmark, argv: list) -> str:
    """What a benchmark's finished JSON was made by: its command, the commit (the code the
    script imports) and the script's own text (it may be edited before it is committed)."""
    with open(os.path.join(REPO, result.script), "rb") as f:
        script = hashlib.sha256(f.read()).hexdigest()
    return f"{shown(argv)}\ncommit {provenance.commit(REPO)[0]}\nscript sha256 {script}\n"


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


# -- one result -------------------------------------------------------------------------------------

def study_for(result, quick: bool) -> spec.Study:
    """The runs of an experiment (its seeds) or a study, as a sweep-runner study."""
    return experiment_study(result, quick) if result.kind == "experiment" else study_of(result, quick)


def signature(result, quick: bool) -> str:
    """What a record must have been made with to be reused: the benchmark's command, or
    what every run's configuration parses to (as the sweep runner compares them)."""
    if result.kind == "benchmark":  # a record from before spreads (another schema) runs again
        return naming.digest(" ".join((result.script,) + result.argv(quick) + (f"spread schema {spread.SCHEMA}",)))
    return naming.digest("\n".join(spec.validate(study_for(result, quick)).values()))


def _sitting(started: dict, load_start: list, meter: Meter, sig: str, ended: str, load_end: list) -> dict:
    """One invocation's part of a result: when, where, from which commit, how it ended."""
    return {"started": started["time"], "finished": provenance.now(),
            "wall_s": round(time.time() - meter.started_at, 1), "commit": started["commit"],
            "dirty": started["dirty"], "machine": started["machine"],
            "load_average_start": load_start, "load_average_end": load_end, "other_cores": meter.other_cores(),
            "ended": ended, "signature": sig}


def run(result, work: str, quick: bool, command: str, parallel: int = 1, settle_s: float = 0.0,
        kept_dir: Optional[str] = None) -> dict:
    """Runs one result (resuming what is on disk) and writes its record; returns it.

    An experiment or study stopped part-way (Ctrl-C, SIGTERM, a failed run) keeps its
    sitting (times, machine, commit, load) in `records/<name>.sittings.json`; the record
    that completes it holds every sitting, and its wall time is their sum. A study that
    needs more hours than one machine session gives is run in several sittings; with
    `kept_dir` (`kept.folder`, committed beside the page) its finished runs and sittings
    so far are kept there too, so the sittings may be on different checkouts."""
    root = os.path.join(work, result.name)
    load_start = settle(settle_s)
    started = provenance.record()
    meter = Meter()
    say(f"{result.name}: started at load average {', '.join(f'{x:.2f}' for x in load_start)}"
        + ("; tiny size" if quick else f"; expected about {result.minutes:g} min on 2 idle cores"))
    sig = signature(result, quick)
    earlier = [] if result.kind == "benchmark" else (  # a benchmark reruns whole
        sittings_of(work, result.name, kept_dir, sig))
    if earlier:
        say(f"{result.name}: sitting {len(earlier) + 1}; the earlier {len(earlier)} took "
            f"{sum(s['wall_s'] for s in earlier) / 60:.1f} min")
    try:
        rec = _run_parts(result, work, quick, command, parallel, root, started, kept_dir)
    except BaseException as e:
        if result.kind != "benchmark":
            ended = "stopped" if isinstance(e, (Stopped, KeyboardInterrupt)) else "failed"
            _save_sittings(work, result.name, kept_dir,
                           earlier + [_sitting(started, load_start, meter, sig, ended, provenance.load_average())])
        raise
    load_end = settle(settle_s)
    sittings = earlier + [_sitting(started, load_start, meter, sig, "complete" if rec["complete"] else "incomplete",
                                   load_end)]
    wall = sum(s["wall_s"] for s in sittings)
    other = None if any(s["other_cores"] is None for s in sittings) else round(
        sum(s["other_cores"] * s["wall_s"] for s in sittings) / max(wall, 1e-6), 2)  # weighted by wall time
    rec.update(started=sittings[0]["started"], load_average_start=sittings[0]["load_average_start"],
               wall_s=round(wall, 1), load_average_end=load_end, finished=provenance.now(), signature=sig,
               other_cores=other)
    if len(sittings) > 1:
        rec["sittings"] = [{k: v for k, v in s.items() if k != "signature"} for s in sittings]
    write_json(record_path(work, result.name), rec, make_dirs=True)
    if rec["complete"]:
        _save_sittings(work, result.name, kept_dir, [])
    elif result.kind != "benchmark":  # a retry resumes it: its sittings go on
        _save_sittings(work, result.name, kept_dir, sittings)
    state = "done" if rec["complete"] else "INCOMPLETE (a run failed; rerun to retry it)"
    say(f"{result.name}: {state} in {rec['wall_s'] / 60:.1f} min"
        + (f" over {len(sittings)} sittings" if len(sittings) > 1 else "") + "; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in rec['load_average_end'])}; other processes used "
        f"{rec['other_cores']} cores on average")
    return rec


def sittings_of(work: str, name: str, kept_dir: Optional[str], sig: Optional[str] = None) -> list[dict]:
    """A result's earlier sittings from the work directory or, where it has none (another
    checkout), from beside the page (`kept_dir`); under signature `sig` when given."""
    return read_sittings(work, name, sig) or [s for s in (kept.read_sittings(kept_dir) if kept_dir else [])
                                              if sig is None or s.get("signature") == sig]


def _save_sittings(work: str, name: str, kept_dir: Optional[str], sittings: list[dict]) -> None:
    """Writes a result's sittings so far (none: it is complete, they go) to the work
    directory and, with `kept_dir`, beside the page."""
    kept.write_sittings(sittings_path(work, name), sittings)
    if kept_dir:
        kept.write_sittings(os.path.join(kept_dir, kept.SITTINGS), sittings)


def _run_parts(result, work: str, quick: bool, command: str, parallel: int, root: str, started: dict,
               kept_dir: Optional[str] = None) -> dict:
    """Runs the result's benchmark script or main.py runs; returns its record, but for the
    times and loads, which `run` adds over every sitting."""
    rec = {"name": result.name, "kind": result.kind, "title": result.title, "quick": quick,
           "reproduce": command, "readme": result.readme,
           "commit": started["commit"], "dirty": started["dirty"], "expframe": started["expframe"],
           "tensorflow": provenance.version("tensorflow"), "keras": provenance.version("keras"),
           "machine": started["machine"]}
    if result.kind == "benchmark":
        data, cmd = run_benchmark(result, root, quick)
        # A benchmark's own --quick (few repeats) is marked on the page as --set=quick is.
        rec.update(commands=[cmd], rows=result.rows(data), spread_schema=spread.SCHEMA,
                   script_quick="--quick" in result.argv(quick) or bool(data.get("quick")), complete=True)
    else:
        study = study_for(result, quick)
        rows, commands = run_sweep(study, root, parallel, kept_dir)
        if any(r["status"] == "stopped" for r in rows):  # Ctrl-C or SIGTERM: each run saved a checkpoint
            raise Stopped(f"{result.name} stopped; rerun the same command to resume it")
        rec.update(commands=[commands[r["run"]] for r in rows], runs=_public(rows),
                   complete=all(r["status"] == "ok" for r in rows))
        if result.kind == "experiment":
            initial = _baseline(result, study, root, quick) if result.baseline and rec["complete"] else {}
            for row in rec["runs"]:
                first = initial.get(row["run"])
                row["initial"] = first
                row["thresholds"] = [{"text": t.text(first), "holds": t.holds(row["final"], first)}
                                     for t in result.thresholds] if row["status"] == "ok" else []
            rec["passed"] = rec["complete"] and all(t["holds"] for r in rec["runs"] for t in r["thresholds"])
            if initial:
                rec["commands"] += [first["command"] for first in initial.values()]
    return rec


def _public(rows: list[dict]) -> list[dict]:
    keep = ("run", "values", "status", "exit_code", "step", "final", "evals", "train_last", "wall_time_s",
            "examples_per_sec", "error", "provenance", "model_dir")
    return [{k: row.get(k) for k in keep} for row in rows]
