"""A study's plots: final metrics against each swept value, and all runs' curves.

`final_metrics.png`: one row of panels per swept dimension (a grid binding, or a zip
group drawn against its first binding), one column per metric (each eval metric,
then examples/s). In a panel, the finished runs that share the values of the other
dimensions form one line; a dimension whose bindings are all seeds (`*.seed`) counts
as repeats: its runs are averaged (the line) and also drawn one by one (the dots),
and it gets no column of its own.

`curves.png`: `expframe.plot.plot_runs` over every run that logged metrics.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from matplotlib.figure import Figure  # Agg; no pyplot, no display

from expframe import plot
from expframe.errors import ConfigError
from expframe.sweep.spec import Axis, Study

FINAL, CURVES = "final_metrics.png", "curves.png"


def _is_seed(axis: Axis) -> bool:
    return all(b.rsplit(".", 1)[-1] == "seed" for b in axis.bindings)


def _number(text: str):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _panel(ax, rows, study: Study, axis: Axis, metric: str, repeats: list[Axis]) -> None:
    keys = study.keys()
    x_key = keys[axis.bindings[0]]
    others = [keys[a.bindings[0]] for a in study.axes if a is not axis and a not in repeats]
    positions = [point[0] for point in axis.values]  # x order: the axis's own order
    labels = [" / ".join(_shown(v) for v in point) for point in axis.values]
    numbers = [_number(p) for p in positions]
    numeric = all(n is not None for n in numbers)
    x_of = dict(zip([_shown(p) for p in positions], numbers if numeric else range(len(positions)), strict=True))
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok" and isinstance(row.get(metric), (int, float)):
            groups.setdefault(tuple(row[k] for k in others), []).append(row)
    for group, members in groups.items():
        by_x: dict[float, list[float]] = {}
        for row in members:
            by_x.setdefault(x_of[row[x_key]], []).append(float(row[metric]))
        xs = sorted(by_x)
        label = ", ".join(f"{k}={v}" for k, v in zip(others, group, strict=True)) or None
        line, = ax.plot(xs, [sum(by_x[x]) / len(by_x[x]) for x in xs], marker="o", label=label)
        if repeats:
            dots = [(x, v) for x in xs for v in by_x[x]]
            ax.scatter([d[0] for d in dots], [d[1] for d in dots], s=12, alpha=0.5, color=line.get_color())
    if numeric and min(numbers) > 0 and max(numbers) / min(numbers) >= 8:
        ax.set_xscale("log", base=2 if all(float(n).is_integer() for n in numbers) else 10)
    ax.set_xticks(list(x_of.values()), labels, fontsize="small", rotation=30 if len(axis.bindings) > 1 else 0)
    ax.minorticks_off()
    together = f" (with {', '.join(keys[b] for b in axis.bindings[1:])})" if len(axis.bindings) > 1 else ""
    ax.set_xlabel(x_key + together, fontsize="small")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if not groups:
        ax.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=ax.transAxes)
    elif any(ax.get_legend_handles_labels()[1]):
        ax.legend(fontsize="x-small")


def _shown(text: str) -> str:
    return text.strip("'\"")


def plot_final(rows: Sequence[dict], study: Study, out: str) -> str:
    """Final metrics against the swept values (see the module docstring) as a PNG."""
    metrics = sorted({k for row in rows for k in row if k.startswith("eval_")}) + ["examples_per_sec"]
    repeats = [a for a in study.axes if _is_seed(a)]
    dims = [a for a in study.axes if a not in repeats] or study.axes  # only seeds: plot against them
    if dims == study.axes:
        repeats = [a for a in repeats if a not in dims]
    fig = Figure(figsize=(4 * len(metrics), 3.4 * len(dims)), layout="constrained")
    axes = fig.subplots(len(dims), len(metrics), squeeze=False)
    for i, axis in enumerate(dims):
        for j, metric in enumerate(metrics):
            _panel(axes[i][j], rows, study, axis, metric, repeats)
    seeds = f"; lines: mean over {', '.join(study.keys()[a.bindings[0]] for a in repeats)}, dots: each run" \
        if repeats else ""
    fig.suptitle(f"study {study.name}: final metrics of the finished runs{seeds}", fontsize="medium")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def plot_study(rows: Sequence[dict], study: Study, root: str) -> list[str]:
    """Writes `<root>/final_metrics.png` and `<root>/curves.png`; returns their paths."""
    written = [plot_final(rows, study, os.path.join(root, FINAL))]
    keys = list(study.keys().values())
    logged, labels = [], []
    for row in rows:
        try:
            plot.read_metrics(os.path.join(root, row["run"]))
        except ConfigError:  # not started, or nothing logged yet
            continue
        logged.append(os.path.join(root, row["run"]))
        labels.append(", ".join(str(row[k]) for k in keys) + ("" if row["status"] == "ok" else f" ({row['status']})"))
    if logged:
        written.append(plot.plot_runs(logged, os.path.join(root, CURVES), labels=labels,
                                      legend_title=", ".join(keys)))
    return written
