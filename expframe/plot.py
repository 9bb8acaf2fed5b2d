"""Curves of runs as one PNG, read from each model_dir's `metrics.jsonl`.

    python -m expframe.plot MODEL_DIR [MODEL_DIR ...] --out curves.png

One panel for the train loss against step, then one per eval metric found in any
run (`top1`, `top5`, `loss`, `fid`, `inception_score`, `episode_return`, ...). All
runs are overlaid; the legend names each run by its model_dir.

From Python:

    from expframe import plot
    plot.plot_runs(["/tmp/run_a", "/tmp/run_b"], out="/tmp/curves.png")
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

from matplotlib.figure import Figure  # draws with Agg; no pyplot, no display needed
from matplotlib.lines import Line2D

from expframe.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
# Eval panels come in this order, then any other metric alphabetically.
_EVAL_ORDER = ("top1", "top5", "loss", "fid", "inception_score", "episode_return")
_COLUMNS = 3


def read_metrics(model_dir: str) -> list[dict]:
    """Reads the records of `<model_dir>/metrics.jsonl`.

    Args:
      model_dir: a run's model_dir.

    Returns:
      The JSON objects of the file, in order.

    Raises:
      ConfigError: the file is missing, empty, or has a line that is not a JSON
        object with an integer "step" and a "split".
    """
    path = os.path.join(model_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: not found; is {model_dir!r} a model_dir of a run that has logged metrics?")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number}: not JSON ({e.msg}); each line must be one JSON object.") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or "split" not in record:
                raise ConfigError(f"{path}:{number}: expected an object with an int \"step\" and a \"split\", "
                                  f"got {line.strip()[:80]}")
            records.append(record)
    if not records:
        raise ConfigError(f"{path}: holds no metrics yet.")
    return records


def _series(records: list[dict], split: str, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric in one split, in step order, skipping non-numbers."""
    points = sorted((r["step"], float(r[metric])) for r in records
                    if r["split"] == split and isinstance(r.get(metric), (int, float))
                    and not isinstance(r.get(metric), bool))
    return [p[0] for p in points], [p[1] for p in points]


def _labels(model_dirs: Sequence[str]) -> list[str]:
    """Each run's name: its directory's base name, or the path where names collide."""
    names = [os.path.basename(os.path.normpath(d)) for d in model_dirs]
    return [name if names.count(name) == 1 else os.path.normpath(d) for name, d in zip(names, model_dirs, strict=True)]


def plot_runs(model_dirs: list[str], out: str, *, labels: Sequence[str] | None = None,
              legend_title: str | None = None) -> str:
    """Plots the runs' train loss and eval metrics against step into one PNG.

    Args:
      model_dirs: model_dirs of runs, each holding a `metrics.jsonl`.
      out: path of the PNG to write; its directory is created if missing.
      labels: each run's name in the legend (default: its directory's base name).
      legend_title: if given, one legend for the whole figure, beside the panels and
        under this title (for many runs), instead of one in every panel.

    Returns:
      `out`.

    Raises:
      ConfigError: no model_dirs, one has no readable `metrics.jsonl`, or labels do
        not name each run once.
    """
    if not model_dirs:
        raise ConfigError("plot_runs: no model_dirs given; pass at least one run's model_dir.")
    labels = list(labels) if labels is not None else _labels(model_dirs)
    if len(labels) != len(model_dirs) or len(set(labels)) != len(labels):
        raise ConfigError(f"plot_runs: {len(labels)} labels for {len(model_dirs)} runs; "
                          "give one distinct label per run.")
    runs = {label: read_metrics(d) for label, d in zip(labels, model_dirs, strict=True)}

    eval_metrics = {key for records in runs.values() for r in records if r["split"] == "eval"
                    for key, value in r.items() if key not in ("step", "split") and isinstance(value, (int, float))}
    ordered = [m for m in _EVAL_ORDER if m in eval_metrics] + sorted(eval_metrics - set(_EVAL_ORDER))
    panels = [("train", "loss")] + [("eval", m) for m in ordered]

    columns = min(_COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(5 * columns, 3.6 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    for ax, (split, metric) in zip(axes, panels, strict=False):  # the grid may have spare axes
        for label, records in runs.items():
            steps, values = _series(records, split, metric)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=label,
                        color=colors[label])
        ax.set_title(f"{split} {metric}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines and legend_title is None:
            ax.legend(fontsize="small")
        elif not ax.lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if legend_title is not None:
        handles = [Line2D([], [], color=colors[label], marker="o", markersize=3) for label in runs]
        fig.legend(handles, list(runs), title=legend_title, loc="outside right upper", fontsize="small",
                   title_fontsize="small")

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


class _OneLineParser(argparse.ArgumentParser):
    """Reports usage errors in one line, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _OneLineParser(prog="python -m expframe.plot",
                            description="Plot train loss and eval metrics of runs into one PNG.")
    parser.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="model_dir holding metrics.jsonl")
    parser.add_argument("--out", required=True, help="PNG file to write, e.g. curves.png")
    args = parser.parse_args(argv)
    try:
        out = plot_runs(args.model_dirs, args.out)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return ConfigError.exit_code
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
