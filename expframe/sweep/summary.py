"""The results table of a study: `summary.csv` and `summary.md` at its root (and, from
the same rows, the study in TensorBoard's HParams dashboard: expframe/sweep/hparams.py).

One row per run, read from the files every run writes (DESIGN.md, Run outputs) and
the study's own record of each attempt (`logs/<name>.json`):

- `run`, then one column per swept binding: the run's name and values;
- `status`: `ok` (result.json written under the study's configuration), `stale`
  (its parsed_config.gin is not the study's: its numbers belong to another
  configuration; rerun with --move_stale), `failed` (exit 1), `config_error` (exit 2),
  `crashed` (killed, or another status), `stopped` (the study was stopped by a
  signal, which it passed on to the run, or exit 0 without a result; rerun to
  resume), `unfinished` (files but no record, e.g. run by Slurm), `pending` (not
  started);
- `exit_code`, `error`: the last attempt's exit status and last error line;
- `step`: result.json's step, else the last logged step;
- `eval_<metric>`: result.json's eval metrics, else the last eval line of metrics.jsonl;
- `wall_time_s`: seconds of every attempt's main.py process, start-up included (for
  runs the study did not start: result.json's `wall_time_s`);
- `examples_per_sec`: median of the logged train rates after the first (which
  includes tracing).
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from typing import Mapping, Optional, Sequence

from expframe.atomic_files import write_text
from expframe.sweep import hparams
from expframe.sweep.runner import LOGS, is_stale, read_record
from expframe.sweep.spec import Study

CSV, MARKDOWN = "summary.csv", "summary.md"
FAILED = {1: "failed", 2: "config_error"}


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_metrics(model_dir: str) -> list[dict]:
    """metrics.jsonl's records; a missing file or a line cut short (a run still
    writing) yields what can be read."""
    records = []
    try:
        with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    records.append(record)
    except OSError:
        pass
    return records


def examples_per_sec(records: Sequence[dict]) -> Optional[float]:
    """Median train rate over the logged intervals, leaving out the first (it includes
    tracing and start-up) when there are at least three."""
    rates = [r["examples_per_sec"] for r in records
             if r.get("split") == "train" and isinstance(r.get("examples_per_sec"), (int, float))]
    if len(rates) >= 3:
        rates = rates[1:]
    return statistics.median(rates) if rates else None


def _status(model_dir: str, result: Optional[dict], attempts: list) -> str:
    last = attempts[-1]["exit_code"] if attempts else None
    if attempts and attempts[-1].get("stopped_by") and not (last == 0 and result is not None):
        return "stopped"
    if last not in (None, 0):
        return FAILED.get(last, "crashed")
    if result is not None:
        return "ok"
    if last == 0:
        return "stopped"
    return "unfinished" if os.path.isdir(model_dir) else "pending"


STALE_ERROR = ("parsed_config.gin is not the study's configuration (a gin file or binding changed since it ran); "
               "rerun with --move_stale to move the old run aside and start afresh")


def collect(study: Study, root: str, config_texts: Optional[Mapping[str, str]] = None) -> list[dict]:
    """One row (column -> value) per run, in the study's order.

    Args:
      study: the study.
      root: its root directory.
      config_texts: run name -> expected parsed_config.gin text (`spec.validate`); a
        run whose parsed_config.gin differs is `stale`. None: not checked.
    """
    keys = study.keys()
    rows = []
    for run in study.runs():
        model_dir = os.path.join(root, run.name)
        result = _read_json(os.path.join(model_dir, "result.json"))
        attempts = read_record(root, run.name)["attempts"]
        records = read_metrics(model_dir)
        row = {"run": run.name}
        row.update({keys[b]: text.strip("'\"") for b, text in run.values})
        stale = config_texts is not None and is_stale(model_dir, config_texts.get(run.name))
        row["status"] = "stale" if stale else _status(model_dir, result, attempts)
        row["exit_code"] = attempts[-1]["exit_code"] if attempts else (0 if result else None)
        steps = [r["step"] for r in records]
        row["step"] = result["step"] if result else (max(steps) if steps else None)
        evals = [r for r in records if r.get("split") == "eval"]
        final = (result or {}).get("eval") or (
            {k: v for k, v in evals[-1].items() if k not in ("step", "split")} if evals else {})
        row.update({f"eval_{k}": v for k, v in final.items() if isinstance(v, (int, float))})
        if attempts:
            row["wall_time_s"] = round(sum(a["wall_time_s"] for a in attempts), 1)
        else:
            row["wall_time_s"] = (result or {}).get("wall_time_s")
        rate = examples_per_sec(records)
        row["examples_per_sec"] = None if rate is None else round(rate, 1)
        row["error"] = attempts[-1]["error"] if attempts and row["status"] != "ok" else ""
        if row["status"] == "stopped" and attempts[-1].get("stopped_by"):
            row["error"] = f"stopped by {attempts[-1]['stopped_by']}; rerun the study to resume"
        if stale:
            row["error"] = STALE_ERROR
        rows.append(row)
    return rows


_ADVICE = {  # status -> what to do about such runs
    "stale": "rerun with --move_stale to move them aside and start afresh",
    "stopped": "rerun the same command to resume",
    "pending": "rerun the same command to run",
    "unfinished": "wait for the jobs running them, or rerun (or resubmit) to resume",
    "failed": "see their logs in {logs}",
    "config_error": "see their logs in {logs}",
    "crashed": "see their logs in {logs}",
}


def not_ok_line(rows: Sequence[dict], root: str, shown: int = 4) -> Optional[str]:
    """One line naming the runs whose status is not `ok` and what to do, or None."""
    by_status: dict[str, list[str]] = {}
    for row in rows:
        if row["status"] != "ok":
            by_status.setdefault(row["status"], []).append(row["run"])
    if not by_status:
        return None
    parts = []
    for status, names in by_status.items():
        listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
        advice = _ADVICE.get(status, "see their logs in {logs}").format(logs=os.path.join(root, LOGS))
        parts.append(f"{len(names)} {status} ({listed}): {advice}")
    count = sum(len(n) for n in by_status.values())
    return f"{count} of {len(rows)} run(s) not ok: " + "; ".join(parts) + "."


def columns(rows: Sequence[dict], study: Study) -> list[str]:
    """Column order: run, swept values, status, step, eval metrics, time, rate, error."""
    metrics = sorted({k for row in rows for k in row if k.startswith("eval_")})
    return (["run"] + list(study.keys().values()) + ["status", "exit_code", "step"] + metrics
            + ["wall_time_s", "examples_per_sec", "error"])


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(rows: Sequence[dict], cols: Sequence[str], title: str, command: str = "") -> str:
    """The table as Markdown, with a title line, the command and a count by status."""
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines = [f"# Study {title}", ""]
    if command:
        lines += [f"    {command}", ""]
    lines += [", ".join(f"{n} {status}" for status, n in counts.items()) + f" of {len(rows)} run(s).", ""]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for row in rows:
        cells = [_cell(row.get(c)).replace("|", "\\|") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(study: Study, root: str, command: str = "",
                  config_texts: Optional[Mapping[str, str]] = None) -> list[dict]:
    """Writes `<root>/summary.csv` and `<root>/summary.md` (`collect`'s rows) and the
    study's TensorBoard HParams summaries (`hparams.write_hparams`); returns the rows."""
    rows = collect(study, root, config_texts)
    cols = columns(rows, study)
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: "" if row.get(c) is None else row.get(c) for c in cols})
    write_text(os.path.join(root, CSV), table.getvalue(), make_dirs=True)
    write_text(os.path.join(root, MARKDOWN), markdown(rows, cols, study.name, command))
    hparams.write_hparams(study, root, rows)
    return rows
