"""A Slurm array job that runs a study's runs on a cluster: one run per array index.

    python -m expframe.sweep --study=experiments/studies/quickstart_batch.gin --emit=slurm \
        --slurm_option=--partition=cpu --slurm_option=--cpus-per-task=8
    sbatch runs/quickstart_batch/study.sbatch
    # when the jobs are done, the table and plots:
    python -m expframe.sweep --study=experiments/studies/quickstart_batch.gin --emit=summary

Index k runs exactly the `main.py` command the local runner would (same gin files,
bindings and model_dir), from the directory the script was written in. The script
carries each run's expected parsed configuration as a SHA-256 digest
(`runner.config_digest`) and compares it with `sha256sum` of the run's
parsed_config.gin, as the local runner does: a run whose `result.json` exists under
the same configuration exits at once, and a resubmitted array resumes the others
from their checkpoints. A stale run (its parsed_config.gin differs: a gin file or
binding changed since it ran) exits 2 with a line saying what to do; written with
`move_stale=True` (`--move_stale`), the script moves it aside to
`<root>/stale/<time>/<name>` (deleting nothing) and starts it afresh. Slurm writes
each index's output to `<root>/logs/slurm-<job>_<k>.out`.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Mapping, Optional, Sequence

from expframe import gin_paths
from expframe.sweep import runner
from expframe.sweep.spec import Study

SCRIPT = "study.sbatch"


def script(study: Study, root: str, config_texts: Mapping[str, str], mode: str = "train_and_eval",
           options: Sequence[str] = (), max_running: Optional[int] = None, main_py: Optional[str] = runner.MAIN_PY,
           move_stale: bool = False) -> str:
    """The text of the array job script.

    Args:
      study: the study.
      root: the study root (as the runs' model_dirs are written).
      config_texts: run name -> expected parsed_config.gin text (`spec.validate`).
      mode: main.py's --mode.
      options: extra `#SBATCH` options, e.g. `--partition=gpu`, `--gres=gpu:8`.
      max_running: at most this many array tasks at once (`--array=0-N%K`).
      main_py: path of main.py.
      move_stale: move a stale run aside and start it afresh (else exit 2 for it).

    Returns:
      A bash script for `sbatch`.
    """
    runs = study.runs()
    last = len(runs) - 1
    throttle = f"%{max_running}" if max_running else ""
    lines = [
        "#!/bin/bash",
        f"# Study '{study.name}': {len(runs)} runs of main.py, one per array index.",
        "# Written by `python -m expframe.sweep --emit=slurm`. Submit with: sbatch "
        + shlex.quote(os.path.join(root, SCRIPT)),
        f"#SBATCH --job-name={study.name}",
        f"#SBATCH --array=0-{last}{throttle}",
        f"#SBATCH --output={os.path.join(os.path.abspath(root), runner.LOGS, 'slurm-%A_%a.out')}",
    ]
    lines += [f"#SBATCH {option}" for option in options]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        f"PYTHON=\"${{PYTHON:-{sys.executable}}}\"",
        *([f"export {gin_paths.SEARCH_PATH_ENV}={shlex.quote(os.environ[gin_paths.SEARCH_PATH_ENV])}"]
          if os.environ.get(gin_paths.SEARCH_PATH_ENV) else []),
        'case "${SLURM_ARRAY_TASK_ID:?submit this script with sbatch: it is a Slurm array job}" in',
    ]
    for run in runs:
        argv = runner.command(study, run, root, mode, main_py)[1:]  # the interpreter is $PYTHON
        model_dir = os.path.join(root, run.name)
        lines.append(f"  {run.index}) NAME={shlex.quote(run.name)}; MODEL_DIR={shlex.quote(model_dir)}")
        lines.append(f"     CONFIG_SHA256={runner.config_digest(config_texts[run.name])}")
        lines.append(f"     ARGS=({' '.join(shlex.quote(a) for a in argv)}) ;;")
    stale_dir = shlex.quote(os.path.join(root, runner.STALE))
    logs = shlex.quote(os.path.join(root, runner.LOGS))
    if move_stale:
        on_stale = [
            f'  STALE_DIR={stale_dir}/$(date +%Y%m%d-%H%M%S)-${{SLURM_ARRAY_JOB_ID:-$$}}',
            '  mkdir -p "$STALE_DIR/logs"; mv "$MODEL_DIR" "$STALE_DIR/$NAME"',
            f'  for f in {logs}/"$NAME".json {logs}/"$NAME".log; do',
            '    if [ -e "$f" ]; then mv "$f" "$STALE_DIR/logs/"; fi',
            "  done",
            '  echo "$NAME: stale (its parsed_config.gin is not this study\'s configuration); moved to '
            '$STALE_DIR/$NAME, starting afresh"',
        ]
    else:
        on_stale = [
            '  echo "$NAME: stale, not started: $MODEL_DIR/parsed_config.gin is not this study\'s configuration (a gin '
            'file or binding changed since it ran), so main.py would refuse to resume it; write this script again '
            'with --emit=slurm --move_stale and resubmit, to move the old run aside and start afresh" >&2',
            "  exit 2",
        ]
    lines += [
        f'  *) echo "array index $SLURM_ARRAY_TASK_ID: this study has runs 0-{last}" >&2; exit 2 ;;',
        "esac",
        "# Finished or stale: the run's parsed_config.gin against the study's configuration.",
        'if [ -f "$MODEL_DIR/parsed_config.gin" ]; then',
        '  command -v sha256sum >/dev/null || { echo "$NAME: sha256sum (coreutils) is not on PATH" >&2; exit 2; }',
        '  if [ "$(sha256sum < "$MODEL_DIR/parsed_config.gin" | cut -d" " -f1)" = "$CONFIG_SHA256" ]; then',
        '    if [ -f "$MODEL_DIR/result.json" ]; then echo "$NAME: finished, skipped"; exit 0; fi',
        "  else",
    ] + ["  " + line for line in on_stale] + [
        "  fi",
        "fi",
        'echo "$NAME: $PYTHON ${ARGS[*]}"',
        'exec "$PYTHON" "${ARGS[@]}"',
    ]
    return "\n".join(lines) + "\n"


def write_script(study: Study, root: str, config_texts: Mapping[str, str], **kwargs) -> str:
    """Writes `<root>/study.sbatch` (executable) and creates `<root>/logs`; returns its path."""
    os.makedirs(os.path.join(root, runner.LOGS), exist_ok=True)
    path = os.path.join(root, SCRIPT)
    with open(path, "w", encoding="utf-8") as f:
        f.write(script(study, root, config_texts, **kwargs))
    os.chmod(path, 0o755)
    return path
