"""`results.md` and its plots, written from the records of `expframe.reproduce.running`.

The page lists every registered result of the sets it covers: those with a record
give their numbers and provenance, the others say which command produces them. It is
rewritten from all records on disk each time, so sets run one after another (e.g.
`--set=learning`, then `--set=studies`) fill one page. Records stay in the work
directory, which is not committed: a result that has no record here but has numbers on
the page as it is (measured in an earlier sitting, on another checkout) keeps its row
and section until it is run again.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import statistics
from typing import Optional, Sequence

import numpy as np
from matplotlib.figure import Figure  # Agg; no pyplot, no display

from expframe import plot
from expframe.atomic_files import write_text
from expframe.errors import ConfigError
from expframe.reproduce import figures, kept, registry, running
from expframe.reproduce.figures import number as _number
from expframe.reproduce.quiet import quiet_rule, verdict

PAGE = "results.md"
IMAGES = "results"  # beside the page: <out>/results/<name>.png


def _load(values: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in values) if values else "unknown"


def _machine(rec: dict) -> str:
    m = rec["machine"]
    return (f"{m['cpu']}, {m['cores']} cores, AVX-512 {'yes' if m['avx512'] else 'no'}, bf16 "
            f"{'yes' if m['bf16'] else 'no'}; {m['platform']}, Python {m['python']}, TensorFlow "
            f"{rec['tensorflow']}, Keras {rec['keras']}, expframe {rec['expframe']}")


def _commit(rec: dict) -> str:
    if rec["commit"] == "not a git checkout":
        return rec["commit"]
    return f"`{rec['commit'][:12]}`" + (" with uncommitted changes" if rec["dirty"] else "")


def work_dir(quick: bool) -> str:
    """`python -m expframe.reproduce`'s default work directory, relative to the repository."""
    return os.path.join("runs", "reproduce_quick" if quick else "reproduce")


def _recorded_work(rec: dict) -> Optional[str]:
    """The work directory `rec` was made in, as its runs and commands name it
    (`<work>/<result>/<run>`)."""
    for run in rec.get("runs") or []:
        if run.get("model_dir"):
            return os.path.dirname(os.path.dirname(os.path.normpath(run["model_dir"])))
    found = re.search(rf"(?:^|[\s='\"])([^\s='\"]+)/{re.escape(rec['name'])}/", "\n".join(rec["commands"]))
    return found.group(1) if found else None


def shown_commands(rec: dict) -> list[str]:
    """`rec`'s commands with its work directory written as the default one (`runs/reproduce/<result>/...`),
    where a reader who runs the page's `python -m expframe.reproduce` command finds them: the page shows no
    machine's absolute paths."""
    work = _recorded_work(rec)
    if not work:
        return list(rec["commands"])
    names = {work}
    if work.startswith(running.REPO + os.sep):  # running.shown wrote these relative to the repository
        names.add(os.path.relpath(work, running.REPO))
    pattern = re.compile(r"(?:^|(?<=[\s='\"]))(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                         + r")(?=/)")
    return [pattern.sub(work_dir(bool(rec.get("quick"))), c) for c in rec["commands"]]


def _sitting_line(i: int, s: dict) -> str:
    m = s["machine"]
    return (f"  {i}. {s['started']} to {s['finished']}, {s['wall_s'] / 60:.1f} min, {s['ended']}; load average "
            f"{_load(s['load_average_start'][:1])} at the start, {_load(s['load_average_end'][:1])} at the end; "
            f"{_commit(s)}; {m['cpu']}, {m['cores']} cores")


def _provenance_lines(rec: dict) -> list[str]:
    other = rec.get("other_cores")
    lines = [f"- Commit: {_commit(rec)}",
            f"- Machine: {_machine(rec)}",
            f"- Load average (1 / 5 / 15 min): {_load(rec['load_average_start'])} at the start, "
            f"{_load(rec['load_average_end'])} at the end; other processes used "
            f"{'unknown' if other is None else f'{other:.2f}'} cores on average while it ran",
            f"- Wall time: {rec['wall_s'] / 60:.1f} min ({rec['wall_s']:,.0f} s), "
            f"{rec['started']} to {rec['finished']}"]
    sittings = rec.get("sittings", [])
    if len(sittings) > 1:  # the commit and machine above are the last sitting's
        lines[-1] += f", in {len(sittings)} sittings (each resumed where the one before stopped; the wall time is " \
                     "their sum, the commit and machine above the last one's):"
        lines += [_sitting_line(i, s) for i, s in enumerate(sittings, 1)]
    return lines + [f"- Reproduce: `{rec['reproduce']}`"]


# -- experiments --------------------------------------------------------------------------------

def _headline(result: registry.Experiment, rec: dict) -> str:
    """`top1 0.94` (mean over seeds when several)."""
    parts = []
    for metric in result.metrics:
        values = [r["final"][metric] for r in rec["runs"] if isinstance(r["final"].get(metric), (int, float))]
        if values:
            parts.append(f"{metric} {_number(statistics.mean(values))}")
    return ", ".join(parts) or "no result"


def _experiment(result: registry.Experiment, rec: dict, images: str, out_dir: str) -> list[str]:
    lines = [f"Result: **{_headline(result, rec)}**" + (f" (mean of {len(rec['runs'])} seeds)"
                                                         if len(rec["runs"]) > 1 else ""), ""]
    lines += ["| run | status | step | " + " | ".join(result.metrics) + " | threshold (slow test) | passed |",
              "|---|---|---|" + "---|" * len(result.metrics) + "---|---|"]
    for run in rec["runs"]:
        cells = [_number(run["final"].get(m, "")) for m in result.metrics]
        checks = run.get("thresholds") or []
        lines.append(f"| {run['run']} | {run['status']} | {_number(run['step'] or 0)} | " + " | ".join(cells)
                     + f" | {'; '.join(t['text'] for t in checks) or '-'} | "
                     + f"{('yes' if all(t['holds'] for t in checks) else '**no**') if checks else '-'} |")
    for run in rec["runs"]:
        evals = [e for e in run.get("evals") or [] if any(m in e for m in result.metrics)]
        if len(evals) > 1:
            lines += ["", f"Evaluations of {run['run']}: " + "; ".join(
                f"step {_number(e['step'])}: " + ", ".join(f"{m} {_number(e[m])}" for m in result.metrics if m in e)
                for e in evals)]
        speed = {k: v for k, v in (run.get("train_last") or {}).items() if k.endswith("_per_sec")}
        if run.get("examples_per_sec") is not None:
            speed["examples_per_sec (median of the logged intervals)"] = run["examples_per_sec"]
        if speed:
            lines += ["", f"Speed of {run['run']} (last logged train interval unless said): "
                      + ", ".join(f"{k} {_number(v)}" for k, v in sorted(speed.items()))
                      + f"; main.py wall time {_number(run.get('wall_time_s') or 0)} s"]
    lines += _published(result, rec)
    initial = [r["initial"] for r in rec["runs"] if r.get("initial")]
    if initial:
        lines += ["", "At initialisation (untrained model, same evaluation): "
                  + "; ".join(", ".join(f"{k} {_number(v)}" for k, v in sorted(i.items()) if k != "command")
                              for i in initial)]
    lines += ["", "Commands:", ""] + [f"    {c}" for c in shown_commands(rec)] + [""]
    lines += _provenance_lines(rec)
    image = _curves(rec, os.path.join(out_dir, IMAGES, f"{result.name}.png"))
    if image:
        lines += ["", f"![{result.name} curves]({images}/{result.name}.png)"]
    grid = _last_samples(rec, os.path.join(out_dir, IMAGES, f"{result.name}_samples.png"))
    if grid:
        lines += ["", f"The last sample grid of {rec['runs'][0]['run']} (`{grid}`; one row per class, the same noise "
                  "down each column):", "", f"![{result.name} samples]({images}/{result.name}_samples.png)"]
    return lines


def _published(result: registry.Experiment, rec: dict) -> list[str]:
    """This result's first metric (mean and range over seeds) above the published ones."""
    if not result.published:
        return []
    metric = result.metrics[0]
    values = [r["final"][metric] for r in rec["runs"] if isinstance(r["final"].get(metric), (int, float))]
    ours = (f"{_number(statistics.mean(values))} (range {_number(min(values))} to {_number(max(values))}, "
            f"{len(values)} seed{'s' if len(values) != 1 else ''})" if values else "no result")
    return ["", f"Beside published results on the same task and budget ({metric}):", "",
            f"| agent | {metric} | source |", "|---|---|---|", f"| this run (expframe D4PG) | {ours} | above |"] + [
        f"| {who} | {_number(mean)} {spread} | {source} |" for who, mean, spread, source in result.published]


def _last_samples(rec: dict, path: str) -> Optional[str]:
    """Copies the first run's last `samples/step_<N>.png` (GAN runs) to `path`; returns its name."""
    model_dir = rec["runs"][0].get("model_dir") if rec["runs"] else None
    grids = glob.glob(os.path.join(model_dir, "samples", "step_*.png")) if model_dir else []
    if not grids:
        return None
    last = max(grids, key=lambda p: int(os.path.basename(p)[len("step_"):-len(".png")]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copyfile(last, path)
    return os.path.join("samples", os.path.basename(last))


def _curves(rec: dict, path: str) -> Optional[str]:
    dirs = [r["model_dir"] for r in rec["runs"] if r.get("model_dir") and os.path.isdir(r["model_dir"])]
    try:
        return plot.plot_runs(dirs, path, labels=[r["run"] for r in rec["runs"] if r.get("model_dir") in dirs])
    except ConfigError:
        return None


# -- studies ------------------------------------------------------------------------------------

def _arm_points(result: registry.StudyResult, rec: dict) -> dict[str, dict[float, list[dict]]]:
    """Arm -> x value -> the finished runs there."""
    arms: dict[str, dict[float, list[dict]]] = {name: {} for name, _ in result.arms}
    for run in rec["runs"]:
        if run["status"] != "ok":
            continue
        for name, member in result.arms:
            if member(run["values"]):
                arms[name].setdefault(float(run["values"][result.x]), []).append(run)
    return arms


def _study_plot(result: registry.StudyResult, arms: dict, path: str) -> str:
    fig = Figure(figsize=(4.6 * len(result.metrics), 3.6), layout="constrained")
    axes = fig.subplots(1, len(result.metrics), squeeze=False)[0]
    for ax, metric in zip(axes, result.metrics, strict=True):
        for i, (arm, points) in enumerate(arms.items()):
            xs = sorted(points)
            means = [statistics.mean(r["final"][metric] for r in points[x]) for x in xs]
            ax.plot(xs, means, marker="o", color=f"C{i}", label=f"{arm} (mean of seeds)")
            dots = [(x, r["final"][metric]) for x in xs for r in points[x]]
            ax.scatter([d[0] for d in dots], [d[1] for d in dots], s=14, alpha=0.5, color=f"C{i}")
        if any(arms.values()):
            ax.set_xscale("log", base=2)
            ticks = sorted({x for points in arms.values() for x in points})
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
            ax.minorticks_off()
        ax.set_xlabel(result.x)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(f"{result.name}: final {', '.join(result.metrics)} against {result.x}; dots: each seed",
                 fontsize="medium")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _beside_runs(result: registry.StudyResult, out_dir: str) -> list[tuple[dict, str]]:
    """(values, model_dir) of the kept runs of `result.beside` (a registered result the
    study varies), values labelled with its name and the run's seed."""
    if not result.beside:
        return []
    folder, runs = kept.folder(out_dir, result.beside), []
    for run in kept.finished(folder):
        seed = dict(part.split("=", 1) for part in run["run"].split(",") if "=" in part).get("seed", "0")
        runs.append(({"as shipped": result.beside, "seed": seed}, os.path.join(folder, run["run"])))
    return runs


def _study_curves(result: registry.StudyResult, rec: dict, path: str,
                  beside: Sequence[tuple[dict, str]] = ()) -> Optional[str]:
    """Each run's eval metrics against `result.curves` (train metric x scale, interpolated at
    the eval steps), colour by configuration (the run's values but its seed: an arm swept over
    `x` has one colour per x), line style by seed, and `beside` ((values, model_dir) from
    `_beside_runs`) in grey for comparison; None when no run has logged both."""
    x_metric, scale, label = result.curves
    fig = Figure(figsize=(6.4 * len(result.metrics), 4.0), layout="constrained")
    axes = fig.subplots(1, len(result.metrics), squeeze=False)[0]
    drawn, colours = False, {}
    runs = [(run["values"], run.get("model_dir"), None) for run in rec["runs"]]
    runs += [(values, model_dir, "0.55") for values, model_dir in beside]
    for values, model_dir, grey in runs:
        if not model_dir or not os.path.isfile(os.path.join(model_dir, plot.METRICS_FILE)):
            continue
        records = plot.read_metrics(model_dir)
        known = sorted((r["step"], float(r[x_metric])) for r in records
                       if r["split"] == "train" and isinstance(r.get(x_metric), (int, float)))
        if not known:
            continue
        config = tuple((k, v) for k, v in values.items() if k != "seed")
        colour = grey or colours.setdefault(config, f"C{len(colours)}")
        name = ", ".join(f"{k} {v}" for k, v in values.items())
        style = ("-", "--", ":", "-.")[int(values.get("seed", 0)) % 4]
        for ax, metric in zip(axes, result.metrics, strict=True):
            points = sorted((r["step"], float(r[metric])) for r in records
                            if r["split"] == "eval" and isinstance(r.get(metric), (int, float)))
            if points:
                xs = np.interp([p[0] for p in points], [k[0] for k in known], [k[1] for k in known]) * scale
                ax.plot(xs, [p[1] for p in points], style, marker="o", markersize=3, color=colour, label=name)
                drawn = True
    if not drawn:
        return None
    for ax, metric in zip(axes, result.metrics, strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel(f"eval {metric}")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="x-small")
    fig.suptitle(f"{result.name}: colour = configuration, line style = seed", fontsize="medium")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _trend(result: registry.StudyResult, arms: dict) -> list[str]:
    """One line per arm and metric: smallest against largest x, beside the seeds' spread."""
    lines = []
    for arm, points in arms.items():
        xs = sorted(points)
        if len(xs) < 2:
            continue
        for metric in result.metrics:
            low = [r["final"][metric] for r in points[xs[0]]]
            high = [r["final"][metric] for r in points[xs[-1]]]
            spread = max((max(v) - min(v) for v in ([r["final"][metric] for r in points[x]] for x in xs)),
                         default=0.0)
            diff = statistics.mean(high) - statistics.mean(low)
            best = (min if metric == "fid" else max)(
                xs, key=lambda x: statistics.mean(r["final"][metric] for r in points[x]))  # noqa: B023
            lower_is_better = metric == "fid"
            if abs(diff) <= spread:
                verdict = "no difference beyond the spread between seeds"
            else:
                verdict = f"the largest {result.x} is " + ("better" if (diff < 0) == lower_is_better else "worse")
            lines.append(f"- {arm}, {metric}: {_number(statistics.mean(low))} at {result.x} {xs[0]:g}, "
                         f"{_number(statistics.mean(high))} at {xs[-1]:g} (change {diff:+.4g}; the largest "
                         f"spread between seeds at one point is {spread:.4g}): {verdict}; best at {best:g}")
    return lines


def _study(result: registry.StudyResult, rec: dict, images: str, out_dir: str) -> list[str]:
    arms = _arm_points(result, rec)
    keys = [k for k in (rec["runs"][0]["values"] if rec["runs"] else {})]
    lines = ["| arm | " + " | ".join(keys) + " | status | step | " + " | ".join(result.metrics) + " |",
             "|---|" + "---|" * len(keys) + "---|---|" + "---|" * len(result.metrics)]
    for run in rec["runs"]:
        names = [name for name, member in result.arms if member(run["values"])] or ["-"]
        lines.append(f"| {', '.join(names)} | " + " | ".join(str(run["values"][k]) for k in keys)
                     + f" | {run['status']} | {_number(run['step'] or 0)} | "
                     + " | ".join(_number(run["final"].get(m, "")) for m in result.metrics) + " |")
    lines += ["", "Means over seeds:", "",
              "| arm | " + result.x + " | seeds | " + " | ".join(f"{m} (mean)" for m in result.metrics) + " |",
              "|---|---|---|" + "---|" * len(result.metrics)]
    for arm, points in arms.items():
        for x in sorted(points):
            runs = points[x]
            lines.append(f"| {arm} | {x:g} | {len(runs)} | " + " | ".join(
                _number(statistics.mean(r["final"][m] for r in runs)) for m in result.metrics) + " |")
    trend = _trend(result, arms)
    if trend:
        lines += ["", f"Smallest against largest {result.x}:", ""] + trend
    _study_plot(result, arms, os.path.join(out_dir, IMAGES, f"{result.name}.png"))
    lines += ["", f"![{result.name}]({images}/{result.name}.png)"]
    beside = _beside_runs(result, out_dir)
    if result.curves and _study_curves(result, rec, os.path.join(out_dir, IMAGES, f"{result.name}_curves.png"),
                                       beside):
        grey = (f"; grey: the kept runs of [{result.beside}](#{result.beside}), as shipped, for comparison"
                if beside else "")
        lines += ["", f"Eval {', '.join(result.metrics)} against {result.curves[2]}, one line per run (the "
                  f"unfinished ones too, as far as they got){grey}:", "",
                  f"![{result.name} curves]({images}/{result.name}_curves.png)"]
    lines += ["", "Commands (one `main.py` run each; "
              f"together `python -m expframe.sweep --study={result.study_file}`):", ""]
    lines += [f"    {c}" for c in shown_commands(rec)] + [""] + _provenance_lines(rec)
    return lines


# -- benchmarks ---------------------------------------------------------------------------------

def _benchmark(result: registry.Benchmark, rec: dict, where: str) -> list[str]:
    """Its table (`figures.table`: spread, repeats, goal and verdict of each figure; a
    goal-bearing figure without its spread is refused), commands and provenance."""
    lines = figures.table(rec, where)
    lines += ["", "Command:", ""] + [f"    {c}" for c in shown_commands(rec)] + [""] + _provenance_lines(rec)
    return lines


# -- the page -----------------------------------------------------------------------------------

def _so_far(sittings: list[dict]) -> str:
    """`started: 2 sittings so far, 150.2 min, ...` for a result stopped part-way."""
    return (f"started: {len(sittings)} sitting{'s' if len(sittings) > 1 else ''} so far, "
            f"{sum(s['wall_s'] for s in sittings) / 60:.1f} min, the last ended {sittings[-1]['finished']}")


def _finished_so_far(result, out_dir: str) -> list[str]:
    """A table of the runs a pending result has finished so far (kept beside the page)."""
    rows = kept.finished(kept.folder(out_dir, result.name))
    if not rows:
        return []
    metrics = getattr(result, "metrics", None) or sorted({k for r in rows for k in r["eval"]})
    lines = ["", f"Finished so far ({len(rows)} run{'s' if len(rows) > 1 else ''}, kept in "
             f"`{os.path.relpath(kept.folder(out_dir, result.name), out_dir)}/`; the final eval):", "",
             "| run | step | " + " | ".join(metrics) + " | wall time |", "|---|---|" + "---|" * len(metrics) + "---|"]
    for r in rows:
        wall = f"{r['wall_time_s'] / 60:.1f} min" if isinstance(r["wall_time_s"], (int, float)) else "-"
        numbers = [_number(r["eval"][m]) if m in r["eval"] else "-" for m in metrics]
        lines.append(f"| {r['run']} | {_number(r['step'])} | " + " | ".join(numbers) + f" | {wall} |")
    return lines


def _summary_row(result, rec: Optional[dict], command: str, sittings: Sequence[dict] = (), where: str = "") -> str:
    if rec is None:
        so_far = f" ({_so_far(list(sittings))}; the command continues it)" if sittings else ""
        return f"| [{result.name}](#{result.name}) | pending{so_far}: `{command}` | | | | | |"
    if result.kind == "experiment":
        number = _headline(result, rec)
        threshold = "; ".join(t.text() for t in result.thresholds)
        passed = "yes" if rec.get("passed") else "**no**"
    elif result.kind == "study":
        number, threshold, passed = f"{sum(r['status'] == 'ok' for r in rec['runs'])} of {len(rec['runs'])} runs", \
            "-", "-"
    else:
        number, threshold, passed = figures.summary_cells(rec, where or result.name)
    return (f"| [{result.name}](#{result.name}) | {number} | {threshold} | {passed} | {rec['finished'][:10]} | "
            f"{_load(rec['load_average_start'][:1])} / {_load(rec['load_average_end'][:1])} ({verdict(rec)}) | "
            f"{rec['wall_s'] / 60:.1f} min |")


def _earlier_results(path: str) -> dict[str, tuple[str, list[str]]]:
    """The results an existing page shows with numbers (not pending): name -> (its summary
    row, the lines of its section from its anchor to the next)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return {}
    rows = {m[1]: m[0] for m in re.finditer(r"^\| \[(\w+)\]\(#\1\) \|(?! pending:).*$", text, re.M)}
    parts = re.split(r'^(?=<a id="\w+"></a>$)', text, flags=re.M)
    out = {}
    for part in parts[1:]:
        name = re.match(r'<a id="(\w+)"></a>', part)[1]
        if name in rows:
            out[name] = (rows[name], [""] + part.rstrip("\n").split("\n"))
    return out


def write(work: str, out_dir: str, quick: bool, results: Sequence, commands: dict[str, str],
          set_lines: Sequence[str]) -> str:
    """Writes `<out_dir>/results.md` and `<out_dir>/results/*.png`; returns the page's path.

    Args:
      work: the reproduce work directory (records under `records/`).
      out_dir: where the page and its images go.
      quick: whether these are --set=quick records (a banner says the numbers mean nothing).
      results: the registered results the page covers, in order.
      commands: result name -> the command that produces it (for pending ones).
      set_lines: Markdown lines describing the sets (commands, expected times).

    Raises:
      ConfigError: a benchmark figure with a goal but no spread, in a record or in a
        section carried from the page (`figures`); nothing is written.
    """
    records = {r.name: running.read_record(work, r.name) for r in results}
    records = {k: v for k, v in records.items() if v is not None and v.get("quick") == quick}
    sittings = {r.name: running.sittings_of(work, r.name, kept.folder(out_dir, r.name)) for r in results}
    path = os.path.join(out_dir, PAGE)
    # Results measured in an earlier sitting whose records are not on this disk (another
    # checkout or machine: records stay in the work directory) keep their row and section
    # from the page as it is, until they are run again here.
    earlier = {} if quick else {name: kept for name, kept in _earlier_results(path).items()
                                if name not in records and not sittings.get(name)}
    # A benchmark section from before intervals is upgraded (its figures marked as measured
    # without a spread) and accepted only as such; see figures.carried.
    benchmarks = {r.name: r for r in results if r.kind == "benchmark"}
    earlier = {name: figures.carried(benchmarks[name], *kept, path) if name in benchmarks else kept
               for name, kept in earlier.items()}
    where = {r.name: running.record_path(work, r.name) for r in results}
    pending = [r.name for r in results if r.name not in records and r.name not in earlier]
    images = IMAGES
    lines = ["# Results", "",
             "Written by `python -m expframe.reproduce` from the runs it made; do not edit by hand: rerun it. "
             "Every result gives the exact commands that produced it, the commit, the machine, the load average "
             "at its start and end (after the machine settled) and the CPU other processes used meanwhile, its "
             "wall time and dates, and the threshold its slow test asserts.", ""]
    if quick:
        lines += ["**Quick smoke (`--set=quick`): every result at a tiny size, to show that the commands run. "
                  "The numbers mean nothing.**", ""]
    if pending:
        lines += [f"**{len(pending)} of {len(results)} results are pending**: each names the command that produces "
                  "it; run it on a quiet machine (see Quiet, under Summary).", ""]
    lines += list(set_lines) + ["", "## Summary", "", f"Quiet: {quiet_rule()}.", "",
                                "| result | number | threshold (slow test) | passed | date | load at start / end "
                                "(quiet) | wall time |", "|---|---|---|---|---|---|---|"]
    lines += [earlier[r.name][0] if r.name in earlier else
              _summary_row(r, records.get(r.name), commands[r.name], sittings[r.name], where[r.name]) for r in results]
    for result in results:
        if result.name in earlier:
            lines += earlier[result.name][1]
            continue
        rec = records.get(result.name)
        lines += ["", f'<a id="{result.name}"></a>', "", f"## {result.title}", ""]
        if result.readme:
            verb = "Quoted in" if result.readme.startswith("README.md") else "Discussed in"
            lines += [f"{verb} [{result.readme.split('#')[0]}](../{result.readme})." if not quick else
                      f"(docs: `{result.readme}`)", ""]
        if rec is None:
            if sittings[result.name]:
                lines += [f"Pending: {_so_far(sittings[result.name])}; rerun `{commands[result.name]}` to continue "
                          "(finished runs are kept, stopped ones resume from their checkpoints)."]
                lines += [_sitting_line(i, s) for i, s in enumerate(sittings[result.name], 1)]
                lines += _finished_so_far(result, out_dir)
            else:
                lines += [f"Pending: not run yet. `{commands[result.name]}`"]
            continue
        if not rec.get("complete", False):
            lines += ["**Incomplete**: a run failed (its error is in the table); rerun the command to retry.", ""]
        if result.kind == "experiment":
            lines += _experiment(result, rec, images, out_dir)
        elif result.kind == "study":
            lines += _study(result, rec, images, out_dir)
        else:
            lines += _benchmark(result, rec, where[result.name])
    write_text(path, "\n".join(lines).rstrip() + "\n", make_dirs=True)
    return path
