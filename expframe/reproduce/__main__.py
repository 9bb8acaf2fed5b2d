"""`python -m expframe.reproduce`: run a set of results, write `results.md` and its plots.

    python -m expframe.reproduce --set=quick                  # every result at a tiny size (minutes)
    python -m expframe.reproduce --set=learning               # the slow learning proofs -> docs/results.md
    python -m expframe.reproduce --set=studies                # the GAN batch-size study
    python -m expframe.reproduce --set=benchmarks             # the benchmarks' ratios
    python -m expframe.reproduce --set=all                    # all three
    python -m expframe.reproduce --set=learning --only=quickstart,vit_shapes_mesh
    python -m expframe.reproduce --set=learning --list        # what it would run, and how long

Runs go to `--work_dir` (default `runs/reproduce`, `runs/reproduce_quick` for quick);
the page to `--out` (default `docs`, and the work directory for quick, so a smoke never
overwrites the committed page). Rerunning a command skips the results already
recorded under the same configuration and resumes the others (each run from its
checkpoint). Exit status: 0 when every result of the set is complete; 1 when one is
not (a run failed: the others still ran); 2 for bad flags; 130 when stopped by Ctrl-C
or SIGTERM (the runs saved checkpoints; rerun the same command to continue).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from typing import Optional, Sequence

from expframe import provenance
from expframe.errors import ConfigError
from expframe.reproduce import kept, page, registry, running

_PROG = "python -m expframe.reproduce"
SET_NAMES = ("quick", "learning", "studies", "benchmarks", "all")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=_PROG, description="Run a set of registered results (expframe/reproduce/registry.py) "
                       "and write results.md with their numbers, commands, commit, machine and load.")
    p.add_argument("--set", required=True, choices=SET_NAMES, dest="set_name",
                   help="quick: every result at a tiny size; learning, studies, benchmarks; all: the three")
    p.add_argument("--only", default="", help="comma-separated result names of the set (default: all of it)")
    p.add_argument("--work_dir", help="runs and records (default runs/reproduce, runs/reproduce_quick for quick)")
    p.add_argument("--out", help="directory of results.md and its images (default docs; the work dir for quick)")
    p.add_argument("--settle_s", type=float, default=None,
                   help="seconds to wait, before and after each result, for the 1-minute load average to fall "
                        "under 1 before recording it (default 120; 0 for quick)")
    p.add_argument("--list", action="store_true", help="print what the set runs and its expected time; run nothing")
    p.add_argument("--page_only", action="store_true",
                   help="rewrite the page from the records on disk, and keep the runs finished in the work "
                        "directory beside it (docs/results/runs/); run nothing")
    return p


def _command(set_name: str, only: Sequence[str] = ()) -> str:
    return f"{_PROG} --set={set_name}" + (f" --only={','.join(only)}" if only else "")


def _set_lines(quick: bool) -> list[str]:
    lines = ["| set | command | results | expected wall time (2 idle cores) |", "|---|---|---|---|"]
    if quick:
        members = registry.results("quick")
        return lines + [f"| quick | `{_command('quick')}` | {len(members)} | a few minutes |"]
    for name, members in registry.SETS.items():
        minutes = sum(r.minutes for r in members) + 2 * len(members)  # + settling
        lines.append(f"| {name} | `{_command(name)}` | {', '.join(r.name for r in members)} | "
                     f"about {minutes:.0f} min |")
    return lines


def _select(set_name: str, only: str) -> list:
    chosen = list(registry.results(set_name))
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        known = {r.name for r in chosen}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(f"--only={only}: {', '.join(unknown)} not in --set={set_name} "
                              f"(it holds {', '.join(sorted(known))}).")
        chosen = [r for r in chosen if r.name in names]
    return chosen


def _interrupt(signum, frame):  # pylint: disable=unused-argument
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if threading.current_thread() is not threading.main_thread():
        return _checked(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops as Ctrl-C does
    try:
        return _checked(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _checked(argv: list[str]) -> int:
    """`_main`, with a configuration error anywhere (e.g. the page refusing a benchmark
    figure with a goal but no spread) as one line and exit 2."""
    try:
        return _main(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ConfigError.exit_code


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    quick = args.set_name == "quick"
    try:
        chosen = _select(args.set_name, args.only)
        if args.settle_s is not None and args.settle_s < 0:
            raise ConfigError(f"--settle_s={args.settle_s} must be at least 0.")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ConfigError.exit_code
    work = args.work_dir or page.work_dir(quick)
    out = args.out or (work if quick else "docs")
    settle_s = args.settle_s if args.settle_s is not None else (0.0 if quick else 120.0)
    if args.list:
        for r in chosen:
            print(f"{r.name} ({r.kind}, about {r.minutes:g} min on 2 idle cores): {r.title}")
        print(f"together about {sum(r.minutes for r in chosen):.0f} min, plus up to {2 * settle_s / 60:.0f} min "
              "per result waiting for the load average to settle")
        return 0
    page_results = registry.results("quick") if quick else registry.ALL
    commands = {r.name: _command("quick" if quick else registry.set_of(r), [r.name]) for r in page_results}
    lines = _set_lines(quick)
    incomplete = []
    if args.page_only:
        for result in chosen:
            if result.kind != "benchmark":
                for name in running.keep_finished(result, work, quick, kept.folder(out, result.name)):
                    running.say(f"{result.name}: kept {name} in {kept.folder(out, result.name)}")
    else:
        expected = "tiny sizes" if quick else f"about {sum(r.minutes for r in chosen):.0f} min on 2 idle cores"
        running.say(f"--set={args.set_name}: {len(chosen)} result(s), {expected}; work dir {work}, page "
                    f"{os.path.join(out, page.PAGE)}; load average "
                    f"{', '.join(f'{x:.2f}' for x in provenance.load_average())}")
        for i, result in enumerate(chosen, 1):
            running.say(f"[{i}/{len(chosen)}] {result.name}")
            try:
                previous = running.read_record(work, result.name)
                if (previous and previous.get("complete") and previous.get("quick") == quick
                        and previous.get("signature") == running.signature(result, quick)):
                    again = running.record_path(work, result.name)
                    if result.kind == "benchmark":  # its finished output would be re-recorded, not re-measured
                        again += f" and {os.path.join(work, result.name)}"
                    running.say(f"{result.name}: recorded {previous['finished']}, skipped (delete {again} to run "
                                "it again)")
                    continue
                rec = running.run(result, work, quick, commands[result.name],
                                  parallel=getattr(result, "parallel", 1), settle_s=settle_s,
                                  kept_dir=None if result.kind == "benchmark" else kept.folder(out, result.name))
                if not rec["complete"]:
                    incomplete.append(result.name)
            except ConfigError as e:
                print(f"error: {result.name}: {e}", file=sys.stderr)
                return ConfigError.exit_code
            except (running.Stopped, KeyboardInterrupt) as e:
                page.write(work, out, quick, page_results, commands, lines)
                running.say(f"{e or 'interrupted'}; stopped. Rerun the same command to continue.")
                return 130
            except Exception:  # pylint: disable=broad-except
                traceback.print_exc()
                running.say(f"{result.name}: FAILED (above); going on with the others")
                incomplete.append(result.name)
            page.write(work, out, quick, page_results, commands, lines)
    path = page.write(work, out, quick, page_results, commands, lines)
    running.say(f"wrote {path}" + (f"; incomplete: {', '.join(incomplete)} (rerun the same command to retry)"
                                   if incomplete else ""))
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
