"""How the results page prints figures: numbers, and each benchmark's table with its
spread, repeat count, goal and verdict (`expframe.reproduce.spread`).

A benchmark row with a goal and no spread is refused (`ConfigError`, one line naming
the record and the row, nothing written): the page shows no goal-bearing figure without
its interval. The one exception is a result measured before intervals existed, whose
section the page carries from an earlier sitting (its record is not on this disk):
`carried` upgrades such a section's table, marking every row `LEGACY`, and accepts
the mark only in a section that finished before `INTERVALS_SINCE`.

`not_for_quoting(page text)` lists the figures a page marks as quick, single-repeat
or without a recorded spread: the README quotes none of them (tests/test_spread.py).
"""

from __future__ import annotations

import re
from typing import Optional

from expframe.errors import ConfigError
from expframe.reproduce import spread
from expframe.reproduce.spread import Goal

HEADER = "| what | value | min / max | 95% interval of the median | repeats | goal | verdict |"
RULE = "|---|---|---|---|---|---|---|"
OLD_HEADER = "| what | value | goal |"  # the table of a benchmark section before intervals
LEGACY = "spread not recorded (measured before intervals; rerun owed)"
INTERVALS_SINCE = "2026-12-06"  # benchmark results finished before this date have no spreads
QUICK = "quick run"
NOTE = ("min / max and the interval: over the repeats' paired ratios (expframe / other: speed over speed; "
        "all-reduce / copy: time over time), a 95% percentile bootstrap interval of their median, ± its wider side "
        "([how, and the verdicts](reproducing.md#benchmark-figures-spread-and-verdicts)); '-': measured once, or not "
        "a time.")


def number(value) -> str:
    """A figure as the page prints it: integers with thousands separators, else 4 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        return f"{int(value):,}"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.1f}"


def _rerun(name: str) -> str:
    return f"`python -m expframe.reproduce --set=benchmarks --only={name}`"


def _goal(row: dict, where: str, name: str) -> Optional[Goal]:
    goal = row.get("goal")
    if not goal:
        return None
    if isinstance(goal, str):  # a record written before goals had a kind and figures a spread
        raise ConfigError(f"{where}: '{row['what']}' has the goal '{goal}' but no spread: it was recorded before "
                          f"intervals. Rerun {_rerun(name)}, or delete the record to keep the "
                          "page's earlier section.")
    return Goal.from_json(goal)


def quick_run(rec: dict) -> bool:
    """Whether `rec` is a quick run: `--set=quick`, or a benchmark script's own --quick."""
    return bool(rec.get("quick") or rec.get("script_quick"))


def _row_line(row: dict, quick: bool, where: str, name: str) -> tuple[str, Optional[Goal], Optional[dict]]:
    goal, found = _goal(row, where, name), row.get("spread")
    if goal and found is None:
        raise ConfigError(f"{where}: '{row['what']}' has a goal ({goal.text()}) but no spread: the page shows no "
                          "goal-bearing figure without its interval and repeat count. Rerun "
                          f"{_rerun(name)} (its benchmark writes `spread`: "
                          "expframe/reproduce/spread.py).")
    if found is not None:
        try:
            spread.check(found, f"{where}: '{row['what']}'")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        minmax = f"{number(found['min'])} / {number(found['max'])}"
        interval = f"{number(found['low'])} to {number(found['high'])} (±{spread.half_width(found):.1%})"
        repeats = f"{found['n']}" + (" points" if found.get("over") == "points" else "")
    else:
        minmax = interval = repeats = "-"
    if quick:
        repeats += f" ({QUICK})"
        verdict = f"no verdict: {QUICK}" if goal else "-"
    else:
        verdict = spread.verdict(found, goal)
    return (f"| {row['what']} | {number(row['value'])} | {minmax} | {interval} | {repeats} | "
            f"{goal.text() if goal else '-'} | {verdict} |"), goal, found


def table(rec: dict, where: str) -> list[str]:
    """The lines of a benchmark record's table, with a banner when it is a quick run;
    `where` names the record in errors (its file).

    Raises:
      ConfigError: a row with a goal and no spread (or a malformed spread).
    """
    quick = quick_run(rec)
    how = "`--set=quick`" if rec.get("quick") else "the benchmark's own `--quick`"
    lines = [f"**Quick run** ({how}): too few repeats to judge; these figures are not for quoting.", ""] if quick \
        else []
    lines += [HEADER, RULE] + [_row_line(r, quick, where, rec["name"])[0] for r in rec["rows"]]
    return lines + ["", NOTE]


def summary_cells(rec: dict, where: str) -> tuple[str, str, str]:
    """(number, goals, verdict) of a benchmark record for the page's summary row."""
    quick = quick_run(rec)
    shown, goals, judged = [], [], []
    for r in rec["rows"]:
        _, goal, found = _row_line(r, quick, where, rec["name"])
        if len(shown) < 2:
            shown.append(number(r["value"]) + (f" ({number(found['low'])} to {number(found['high'])})"
                                                if found and found["n"] > 1 else ""))
        if goal:
            goals.append(goal.text())
            judged.append(spread.regression(found, goal))
    text = "; ".join(shown) + (" ..." if len(rec["rows"]) > 2 else "")
    if not goals:
        return text, "-", "-"
    if quick:
        return text, "; ".join(dict.fromkeys(goals)), QUICK
    failed = sum(judged)
    return text, "; ".join(dict.fromkeys(goals)), f"**{failed} regression(s)**" if failed else "no regression"


# -- sections carried from an earlier page --------------------------------------------------------

def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _finished(lines: list[str]) -> Optional[str]:
    found = re.search(r"^- Wall time: .*, (\S+) to (\S+?)(?:,|$)", "\n".join(lines), re.M)
    return found.group(2)[:10] if found else None


def carried(result, summary: str, lines: list[str], page_path: str) -> tuple[str, list[str]]:
    """A benchmark's summary row and section as carried from an earlier page: a table from
    before intervals is upgraded, marking `LEGACY` every figure that a rerun gives a spread
    (all of a `repeated` benchmark's, and any with a goal); a table of today's form is
    checked. Either way the mark is accepted only in a section finished before
    `INTERVALS_SINCE`, and every goal-bearing row of any other must show its interval.

    Args:
      result: its `registry.Benchmark`.
      summary, lines: its summary row and section lines, as on the page.
      page_path: the page, for errors.

    Raises:
      ConfigError: naming the page, the section and the row.
    """
    name, where = result.name, f"{page_path}: section {result.name}"
    try:
        at = next(i for i, line in enumerate(lines) if line in (HEADER, OLD_HEADER))
    except StopIteration:
        raise ConfigError(f"{where}: no benchmark table ({HEADER}); rerun {_rerun(name)}") from None
    finished = _finished(lines)
    before = finished is not None and finished < INTERVALS_SINCE
    end = next((i for i in range(at + 2, len(lines)) if not lines[i].startswith("|")), len(lines))
    if lines[at] == OLD_HEADER:
        rows, owed = [], False
        quick = any(line.startswith("    python ") and " --quick" in line for line in lines)
        for what, value, goal in map(_cells, lines[at + 2:end]):
            if result.repeated or goal != "-":
                if not before:
                    raise ConfigError(f"{where}: '{what}' has no spread but the section finished on {finished}, "
                                      f"not before {INTERVALS_SINCE} (when intervals came): rerun {_rerun(name)}.")
                repeats = "not recorded" + (f" ({QUICK})" if quick else "")
                rows.append(f"| {what} | {value} | {LEGACY} | - | {repeats} | {goal} | no verdict: no interval |")
                owed = True
            else:  # bytes, or a rate measured once: as a rerun shows it
                rows.append(f"| {what} | {value} | - | - | -{f' ({QUICK})' if quick else ''} | - | - |")
        note = ["", f"Measured before intervals (issue 53): a rerun on a quiet machine is owed, {_rerun(name)}."]
        lines = lines[:at] + [HEADER, RULE] + rows + (note if owed else ["", NOTE]) + lines[end:]
        cells = _cells(summary)
        if owed and "rerun owed" not in cells[1]:
            cells[1] += " (spread not recorded; rerun owed)"
        return "| " + " | ".join(cells) + " |", lines
    for line in lines[at + 2:end]:
        cells = _cells(line)
        if len(cells) != 7:
            raise ConfigError(f"{where}: the row '{line}' does not have the table's 7 cells; rerun {_rerun(name)}.")
        what, _, minmax, interval, _, goal, _ = cells
        if minmax == LEGACY and not before:
            raise ConfigError(f"{where}: '{what}' is marked '{LEGACY}', which only a result finished before "
                              f"{INTERVALS_SINCE} may carry (this one: {finished}); rerun {_rerun(name)}.")
        if goal != "-" and minmax != LEGACY and interval == "-":
            raise ConfigError(f"{where}: '{what}' has a goal ({goal}) but no interval; rerun {_rerun(name)}.")
    return summary, lines


def not_for_quoting(text: str) -> list[tuple[str, str, str]]:
    """(section, what, value) of every benchmark figure a page marks quick, single-repeat
    or without a recorded spread."""
    out = []
    for name, body in zip(*[iter(re.split(r'^<a id="(\w+)"></a>$', text, flags=re.M)[1:])] * 2, strict=True):
        rows = body.split(HEADER + "\n" + RULE + "\n", 1)
        if len(rows) < 2:
            continue
        for line in rows[1].split("\n"):
            if not line.startswith("|"):
                break
            what, value, minmax, _, repeats = _cells(line)[:5]
            if QUICK in repeats or repeats.split(" ")[0] == "1" or minmax == LEGACY:
                out.append((name, what, value))
    return out
