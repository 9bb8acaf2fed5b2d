"""The results page's benchmark figures (issue 53): each with its spread, repeat count
and verdict; a goal-bearing figure without its spread refused; sections measured before
intervals marked as such, and only those; README quotes no figure the page marks quick,
single-repeat or without a spread. Records here are synthetic: no benchmark runs."""

import json
import os
import re

import pytest

from expframe.errors import ConfigError
from expframe.reproduce import __main__ as cli
from expframe.reproduce import benchmark_rows, figures, page, registry, running, spread
from tests import main_runner as mr

RUNNER = registry.get("runner_overhead")


def _record(rows, quick=False, script_quick=False, name="runner_overhead"):
    return {"name": name, "kind": "benchmark", "quick": quick, "script_quick": script_quick, "complete": True,
            "reproduce": f"python -m expframe.reproduce --set=benchmarks --only={name}",
            "commands": [f"python benchmarks/{name}.py --out=runs/reproduce/{name}/{name}.running.json"],
            "started": "2026-12-07T10:00:00+00:00", "finished": "2026-12-07T10:20:00+00:00", "wall_s": 1200.0,
            "commit": "0" * 40, "dirty": False, "expframe": "0.1.0", "tensorflow": "2.21.0", "keras": "3.15.1",
            "machine": {"cpu": "Test CPU", "cores": 2, "avx512": False, "bf16": True, "platform": "Linux",
                        "python": "3.11.7"},
            "load_average_start": [0.1, 0.1, 0.1], "load_average_end": [0.2, 0.1, 0.1], "other_cores": 0.01,
            "rows": rows}


def _write(work, rec):
    os.makedirs(os.path.join(work, running.RECORDS), exist_ok=True)
    with open(running.record_path(work, rec["name"]), "w", encoding="utf-8") as f:
        json.dump(rec, f)


def _section(text, name):
    return re.split(r'<a id="\w+"></a>', text.split(f'<a id="{name}"></a>', 1)[1])[0]


# The paired ratios of runner_overhead.py's JSON, as it writes them (synthetic times).
_DATA = {"goal_ratio": 0.97, "results": [
    {"num_replicas": n, "median_paired_ratio": r, "spread": {"expframe_over_handwritten": spread.of(values)}}
    for n, values in ((1, [0.98, 1.01, 1.03, 0.99, 1.02]), (2, [0.90, 0.92, 0.94, 0.93, 0.91]))
    for r in [spread.of(values)["median"]]]}


def test_each_ratio_shows_its_interval_repeats_and_verdict(tmp_path):
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    rows = benchmark_rows.runner_overhead(_DATA)
    assert [r["goal"] for r in rows] == [{"kind": "parity", "value": 0.97}] * 2
    _write(work, _record(rows))
    text = open(page.write(work, out, False, [RUNNER], {RUNNER.name: "x"}, []), encoding="utf-8").read()
    body = _section(text, RUNNER.name)
    assert figures.HEADER in body
    assert ("| expframe Trainer / hand-written loop, examples/s, 1 replica(s) (paired) | 1.01 | 0.98 / 1.03 | "
            "0.98 to 1.03 (±3.0%) | 5 | parity (1.00); regression below 0.97 | parity within noise |") in body
    assert ("| expframe Trainer / hand-written loop, examples/s, 2 replica(s) (paired) | 0.92 | 0.9 / 0.94 | "
            "0.9 to 0.94 (±2.2%) | 5 | parity (1.00); regression below 0.97 | behind; **regression** (whole "
            "interval below 0.97) |") in body
    assert "| [runner_overhead](#runner_overhead) | 1.01 (0.98 to 1.03); 0.92 (0.9 to 0.94) | parity (1.00); " \
           "regression below 0.97 | **1 regression(s)** |" in text
    assert figures.not_for_quoting(text) == []


def test_a_goal_bearing_ratio_without_its_spread_is_refused(tmp_path, capsys):
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    rows = benchmark_rows.runner_overhead(_DATA)
    rows[1]["spread"] = None   # as a script from before spreads, or a row function that forgot it
    _write(work, _record(rows))
    with pytest.raises(ConfigError, match=r"runner_overhead\.json: 'expframe Trainer / hand-written loop, "
                                          r"examples/s, 2 replica\(s\) \(paired\)' has a goal \(parity \(1\.00\); "
                                          r"regression below 0\.97\) but no spread: .* Rerun `python -m "
                                          r"expframe\.reproduce --set=benchmarks --only=runner_overhead`"):
        page.write(work, out, False, [RUNNER], {RUNNER.name: "x"}, [])
    assert not os.path.exists(os.path.join(out, page.PAGE))   # nothing written
    # A record from before goals had a kind (the goal as text, no spread): the same refusal.
    _write(work, _record([{"what": "ratio", "value": 1.05, "goal": "goal >= 0.97"}]))
    with pytest.raises(ConfigError, match="has the goal 'goal >= 0.97' but no spread: it was recorded before"):
        page.write(work, out, False, [RUNNER], {RUNNER.name: "x"}, [])
    # From the command line: one line, exit 2.
    assert cli.main(["--set=benchmarks", "--only=runner_overhead", "--page_only", f"--work_dir={work}",
                     f"--out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no spread" in err
    # Figures without a goal (MFU, bytes, rates) may go without one.
    _write(work, _record([benchmark_rows.row("bytes", 622)]))
    assert "| bytes | 622 | - | - | - | - | - |" in open(page.write(work, out, False, [RUNNER], {RUNNER.name: "x"},
                                                                     []), encoding="utf-8").read()


def test_quick_and_single_repeat_figures_are_marked_and_not_for_quoting(tmp_path):
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    one = [benchmark_rows.row("ratio, one repeat", 0.91, spread.parity(), spread.of([0.91]))]
    _write(work, _record(one))
    text = open(page.write(work, out, False, [RUNNER], {RUNNER.name: "x"}, []), encoding="utf-8").read()
    assert "| 1 | parity (1.00); regression below 0.97 | no verdict: 1 repeat |" in text
    assert figures.not_for_quoting(text) == [("runner_overhead", "ratio, one repeat", "0.91")]
    quick = [benchmark_rows.row("ratio", 0.93, spread.parity(), spread.of([0.92, 0.93, 0.95]))]
    _write(work, _record(quick, script_quick=True))
    text = open(page.write(work, out, False, [RUNNER], {RUNNER.name: "x"}, []), encoding="utf-8").read()
    assert "**Quick run** (the benchmark's own `--quick`)" in text
    assert "| 3 (quick run) | parity (1.00); regression below 0.97 | no verdict: quick run |" in text
    assert figures.not_for_quoting(text) == [("runner_overhead", "ratio", "0.93")]


_OLD = ["", '<a id="runner_overhead"></a>', "", "## title", "", figures.OLD_HEADER, "|---|---|---|",
        "| expframe / hand-written loop (paired median) | 1.055 | goal >= 0.97 |", "", "Command:", "",
        "    python benchmarks/runner_overhead.py --quick --out=x", "",
        "- Wall time: 15.9 min (954 s), 2026-12-02T11:11:49+00:00 to {finished}"]
_ROW = "| [runner_overhead](#runner_overhead) | 1.055 | - | - | 2026-12-02 | 0.93 / 1.80 (yes) | 15.9 min |"


def test_sections_measured_before_intervals_are_marked_and_only_those():
    old = [line.format(finished="2026-12-02T11:27:43+00:00") for line in _OLD]
    row, lines = figures.carried(RUNNER, _ROW, old, "docs/results.md")
    assert f"| expframe / hand-written loop (paired median) | 1.055 | {figures.LEGACY} | - | not recorded (quick " \
           "run) | goal >= 0.97 | no verdict: no interval |" in lines
    assert "1.055 (spread not recorded; rerun owed)" in row
    assert figures.carried(RUNNER, row, lines, "docs/results.md") == (row, lines)   # carried again: as it is
    assert figures.not_for_quoting("\n".join(lines)) == [("runner_overhead", "expframe / hand-written loop "
                                                          "(paired median)", "1.055")]
    late = [line.format(finished="2026-12-07T09:00:00+00:00") for line in _OLD]
    with pytest.raises(ConfigError, match="docs/results.md: section runner_overhead: 'expframe / hand-written loop "
                                          r"\(paired median\)' has no spread but the section finished on 2026-12-07"):
        figures.carried(RUNNER, _ROW, late, "docs/results.md")
    # The mark pasted into a section measured since is refused, as is a goal without an interval.
    marked = [line.replace("2026-12-02T11:27", "2026-12-07T11:27") for line in lines]
    with pytest.raises(ConfigError, match="which only a result finished before 2026-12-06 may carry"):
        figures.carried(RUNNER, row, marked, "docs/results.md")
    bare = [line.replace(f"{figures.LEGACY} | -", "- | -") for line in marked]
    with pytest.raises(ConfigError, match=r"has a goal \(goal >= 0.97\) but no interval"):
        figures.carried(RUNNER, row, bare, "docs/results.md")


def _quoted(text: str, value: str) -> list[str]:
    """The numbers of `text` (2 or more decimals) that are `value` rounded to their decimals."""
    v = float(value.replace(",", ""))
    return [x for x in re.findall(r"(?<![\d.])\d+\.\d{2,}(?![\d.])", text) if f"{v:.{len(x.split('.')[1])}f}" == x]


def test_readme_quotes_no_figure_the_page_marks_quick_single_repeat_or_unmeasured():
    with open(os.path.join(mr.ROOT, "docs", page.PAGE), encoding="utf-8") as f:
        flagged = figures.not_for_quoting(f.read())
    with open(os.path.join(mr.ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()

    def quoting(text, marked):
        quoted = {(name, what, value): _quoted(text, value) for name, what, value in marked}
        return {k: v for k, v in quoted.items() if v}

    # The check can fail: a README quoting a figure the page marks is caught.
    marked = [("resnet50_throughput", "expframe / hand-written loop, images/s, 224 px", "0.649")]
    assert quoting("expframe runs at 0.65 of a hand-written loop", marked) == {marked[0]: ["0.65"]}
    assert not quoting(readme, flagged), "README quotes figures the page marks not for quoting"


def test_the_benchmarks_set_runs_no_quick_script_and_enough_repeats():
    for bench in registry.BENCHMARKS:
        assert "--quick" not in bench.args, bench.name   # its figures would be marked quick
    for name in ("runner_overhead", "resnet50_throughput", "collectives", "fit_gap", "imagenet_input",
                 "data_service_overhead", "own_process"):
        args = registry.get(name).args
        assert args[args.index("--repeats") + 1] == str(spread.REPEATS), name
    assert {b.name for b in registry.BENCHMARKS if b.repeated} == {
        "runner_overhead", "resnet50_throughput", "scaling", "collectives", "sync_batch_norm", "fit_gap",
        "imagenet_input", "data_service_overhead", "own_process"}
    # The set's time as docs/reproducing.md states it: 68 min measured before sync_batch_norm's
    # estimated 45 (issue 59), 117 as --list rounds it up; fit_gap's 12 (measured 12.1,
    # issue 61) and imagenet_input's 10 (measured 9.6, issue 62) since, and
    # resnet50_throughput at float32 and 'auto' 24 (measured 23.8; 14 before), and
    # data_service_overhead's 4 (measured 3.2, issue 62), own_process's 30 (measured 30.0, issue 61);
    # with every runner timed on the second of two calls (issue 61): resnet50_throughput 30 (measured
    # 30.1 and 29.4), fit_gap 16 (measured 15.5).
    assert sum(b.minutes for b in registry.BENCHMARKS) == 193
