"""Finished runs kept beside the results page, so that one result spans checkouts.

`python -m expframe.reproduce` runs in a work directory (`runs/reproduce`, not committed).
A study of several hours may need sittings on different checkouts or machines, and a work
directory does not travel. So each finished main.py run's small files (its configuration,
result, metrics and attempts; never its checkpoints or events) are copied to
`<page dir>/results/runs/<result>/<run>/`, committed with the page, and the result's
sittings so far to `<page dir>/results/runs/<result>/sittings.json`. A later sitting in
an empty work directory restores each kept run whose parsed configuration equals the
study's, so the sweep runner counts it finished and does not run it again; a kept run
of another configuration (a gin file edited since) is left where it is and runs afresh.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from expframe.atomic_files import write_json, write_text
from expframe.sweep import runner
from expframe.sweep.spec import Study

RUNS = os.path.join("results", "runs")  # under the page's directory
STALE = "stale"    # kept runs of an earlier configuration of the study
FILES = ("config.gin", "operative_config.gin", "parsed_config.gin", "result.json", "metrics.jsonl")
ATTEMPTS = "attempts.json"  # the sweep runner's logs/<run>.json: exit codes and wall times
SITTINGS = "sittings.json"


def folder(out_dir: str, name: str) -> str:
    """Where result `name`'s finished runs are kept, for a page written to `out_dir`."""
    return os.path.join(out_dir, RUNS, name)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def keep(study: Study, root: str, kept: str, texts: dict[str, str]) -> list[str]:
    """Copies each run of `study` finished in `root` under its configuration (`texts`: run
    name -> parsed_config.gin text) to `kept/<run>/`; returns the names newly kept."""
    new = []
    for run in study.runs():
        model_dir, dest = os.path.join(root, run.name), os.path.join(kept, run.name)
        if not runner.is_finished(model_dir, texts[run.name]):
            continue
        if _read(os.path.join(dest, "parsed_config.gin")) != texts[run.name]:
            new.append(run.name)
        for name in FILES:
            text = _read(os.path.join(model_dir, name))
            if text is not None and text != _read(os.path.join(dest, name)):
                write_text(os.path.join(dest, name), text, make_dirs=True)
        attempts = _read(os.path.join(root, runner.LOGS, f"{run.name}.json"))
        if attempts is not None and attempts != _read(os.path.join(dest, ATTEMPTS)):
            write_text(os.path.join(dest, ATTEMPTS), attempts, make_dirs=True)
    return new


def restore(study: Study, root: str, kept: str, texts: dict[str, str]) -> list[str]:
    """Copies each kept run of `study` into `root` where `root` has no folder of that name
    and the kept run finished under the same configuration; returns the names restored.
    A folder is copied whole under another name and then renamed, so a run is restored
    entirely or not at all."""
    restored = []
    for run in study.runs():
        src, model_dir = os.path.join(kept, run.name), os.path.join(root, run.name)
        if os.path.exists(model_dir) or not runner.is_finished(src, texts[run.name]):
            continue
        partial = model_dir + ".restoring"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        for name in FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(partial, name))
        attempts = _read(os.path.join(src, ATTEMPTS))
        if attempts is not None:
            write_text(os.path.join(root, runner.LOGS, f"{run.name}.json"), attempts, make_dirs=True)
        os.replace(partial, model_dir)
        restored.append(run.name)
    return restored


def set_aside_stale(study: Study, kept: str, texts: dict[str, str]) -> list[str]:
    """Moves each kept run of `study` finished under another configuration (a gin file
    edited since) to `kept/stale/<run>/`, so that the page lists only the runs of the
    study as it is now; returns the names moved. The old runs stay there for reference
    (and in the repository's history) until a later one of that name replaces them."""
    moved = []
    for run in study.runs():
        src = os.path.join(kept, run.name)
        if not os.path.isdir(src) or runner.is_finished(src, texts[run.name]):
            continue
        dest = os.path.join(kept, STALE, run.name)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(src, dest)
        moved.append(run.name)
    return moved


def finished(kept: str) -> list[dict]:
    """The kept runs' results, by run name: {"run", "step", "eval", "wall_time_s"}."""
    rows = []
    for name in sorted(os.listdir(kept)) if os.path.isdir(kept) else []:
        text = _read(os.path.join(kept, name, "result.json"))
        if text is None:
            continue
        result = json.loads(text)
        rows.append({"run": name, "step": result.get("step"), "eval": result.get("eval") or {},
                     "wall_time_s": result.get("wall_time_s")})
    return rows


def read_sittings(kept: str) -> list[dict]:
    text = _read(os.path.join(kept, SITTINGS))
    try:
        sittings = json.loads(text) if text else []
    except ValueError:
        return []
    return [s for s in sittings if isinstance(s, dict)]


def write_sittings(path: str, sittings: list[dict]) -> None:
    """Writes a result's sittings so far to `path` (none: removes it, the result is complete)."""
    if sittings:
        write_json(path, sittings, make_dirs=True)
    elif os.path.exists(path):
        os.remove(path)
