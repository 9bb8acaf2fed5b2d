"""`python -m expframe.sweep`: run a study, resume it, or hand it to Slurm.

    python -m expframe.sweep --study=experiments/studies/quickstart_batch.gin [--parallel=2]
    python -m expframe.sweep --gin_file=experiments/quickstart.gin \
        --sweep='Trainer.global_batch_size=[64, 128, 256]' --sweep='run_experiment.seed=[0, 1]'
    python -m expframe.sweep --study=... --emit=slurm     # writes <root>/study.sbatch, runs nothing
    python -m expframe.sweep --study=... --emit=summary   # table and plots from what is on disk

Exit status: 0 only when every run is `ok` (finished under the study's configuration);
130 for a Ctrl-C before any run started (or while the summary is written);
1 otherwise (a run failed, was stopped, is pending, or is stale), with one line on
stderr naming those runs and what to do (also for --emit=summary, which writes the
table either way); 2 for a configuration error in the study, found before any run
starts (one line on stderr naming the binding; nothing written).
"""

import argparse
import os
import shlex
import sys
from typing import Optional, Sequence

from expframe import gin_paths, tf_noise
from expframe.atomic_files import write_json
from expframe.errors import ConfigError
from expframe.sweep import plots, runner, slurm, spec, summary

_PROG = "python -m expframe.sweep"


class _OneLineParser(argparse.ArgumentParser):
    """Reports usage errors in one line, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=_PROG, description="Run a study: one main.py run per point of a sweep of gin "
                       "bindings, then a results table (summary.csv, summary.md) and plots.")
    p.add_argument("--study", help="study file (gin with sweep/ and zip/ bindings), e.g. "
                   "experiments/studies/quickstart_batch.gin")
    p.add_argument("--gin_file", action="append", default=[], help="base gin file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="binding for every run (repeatable)")
    p.add_argument("--sweep", action="append", default=[], metavar="B=[V, ...]",
                   help="grid axis, e.g. 'Trainer.global_batch_size=[64, 128]' (repeatable)")
    p.add_argument("--zip", action="append", default=[], metavar="B=[V, ...]",
                   help="bindings that move together, one value of each per run (repeatable; one group)")
    p.add_argument("--gin_search_path", action="append", default=[], metavar="DIR",
                   help="folder searched for gin files and the modules they import, for the study and its runs "
                        "(repeatable; see main.py --help)")
    p.add_argument("--study_dir", help="the study's root (default runs/<study name>)")
    p.add_argument("--parallel", type=int, default=None,
                   help="runs at once on this machine, at most its cores (default 1); with --emit=slurm, "
                        "array tasks at once")
    p.add_argument("--mode", default="train_and_eval", choices=("train", "train_and_eval"),
                   help="main.py's --mode for every run ('train': no evaluation, e.g. for speed)")
    p.add_argument("--emit", choices=("slurm", "summary"),
                   help="instead of running: 'slurm' writes <root>/study.sbatch, 'summary' writes the "
                        "table and plots from the runs on disk")
    p.add_argument("--slurm_option", action="append", default=[], metavar="OPT",
                   help="extra #SBATCH option for --emit=slurm, e.g. --slurm_option=--partition=gpu")
    p.add_argument("--move_stale", action="store_true",
                   help="move runs whose parsed_config.gin is not the study's configuration (a gin file or "
                        "binding changed since they ran) to <root>/stale/<time>/ and start them afresh; without "
                        "it they are reported `stale` and not started (nothing is ever deleted)")
    return p


def _write_study_json(study: spec.Study, root: str) -> None:
    data = {"name": study.name, "gin_files": study.gin_files, "gin_params": study.gin_params,
            "axes": [{"bindings": list(a.bindings), "values": [list(v) for v in a.values], "origin": a.origin}
                     for a in study.axes],
            "runs": [{"name": r.name, "bindings": dict(r.values)} for r in study.runs()]}
    write_json(os.path.join(root, "study.json"), data)


def _report(study: spec.Study, root: str, command: str, config_texts: dict) -> int:
    """Writes and prints the table, draws the plots; 0 if every run is ok, else 1 (and a line)."""
    rows = summary.write_summary(study, root, command, config_texts)
    written = plots.plot_study(rows, study, root)
    with open(os.path.join(root, summary.MARKDOWN), encoding="utf-8") as f:
        print(f.read(), end="")
    print("wrote " + ", ".join(os.path.join(root, n) for n in (summary.CSV, summary.MARKDOWN)) + ", "
          + ", ".join(written), flush=True)
    line = summary.not_ok_line(rows, root)
    if line:
        print(f"error: {line}", file=sys.stderr, flush=True)
    return 1 if line else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns its exit status. TensorFlow's start-up notices (the
    study process imports it to validate the study) are hidden as main.py hides them
    (expframe/tf_noise.py); every other line passes."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as main.py; the runs inherit it
    try:
        with tf_noise.quiet_start():
            return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while validating or summarising (the runs' own are forwarded)
        print(f"{_PROG}: stopped by SIGINT; no run is running. Rerun the same command to continue.",
              file=sys.stderr, flush=True)
        return 130


def _main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    command = shlex.join([_PROG.split()[0], "-m", "expframe.sweep"] + argv)
    try:
        if args.parallel is not None and args.parallel < 1:
            raise ConfigError(f"--parallel={args.parallel} must be at least 1.")
        gin_paths.add_search_path(args.gin_search_path)  # the runs inherit $EXPFRAME_GIN_PATH
        study = spec.build_study(args.study, args.gin_file, args.gin_param, args.sweep, args.zip)
        root = args.study_dir or os.path.join("runs", study.name)
        config_texts = spec.validate(study)  # nothing is written before this passes
        if args.emit == "summary":
            return _report(study, root, command, config_texts)
        if args.emit == "slurm":
            path = slurm.write_script(study, root, config_texts, mode=args.mode, options=args.slurm_option,
                                      max_running=args.parallel, move_stale=args.move_stale)
            print(f"wrote {path}: {len(study.runs())} runs, one per array index; submit with `sbatch {path}`, "
                  f"then `{command.replace('--emit=slurm', '--emit=summary')}` for the table and plots")
            return 0
    except ConfigError as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return ConfigError.exit_code
    os.makedirs(root, exist_ok=True)
    _write_study_json(study, root)
    runner.run_study(study, root, config_texts, parallel=args.parallel or 1, mode=args.mode,
                     on_change=lambda: summary.write_summary(study, root, command, config_texts),
                     move_stale=args.move_stale)
    return _report(study, root, command, config_texts)


if __name__ == "__main__":
    sys.exit(main())
