"""Slurm batch scripts whose runs survive time limits and preemption: warned, checkpointed, requeued.

    python -m expframe.launch --emit=slurm --workers=4 --slurm_option=--nodes=4 -- main.py \
        --gin_file=experiments/resnet50_imagenet_multi_worker.gin > resnet50.sbatch
    sbatch resnet50.sbatch

The recipe (the same in `python -m expframe.sweep --emit=slurm`'s array jobs):

- `#SBATCH --signal=B:TERM@<grace>`: `grace` seconds before the time limit Slurm sends
  SIGTERM to the batch shell alone (`B:`). The script traps it and forwards it to the
  run: to main.py, or to the `srun` job step, which forwards it to every task. Each
  worker's Trainer finishes its current host call, the workers agree on the step,
  the chief saves a checkpoint, and main.py exits 0. The script waits for that, then
  requeues the job itself (`scontrol requeue`: Slurm does not requeue a job for its
  time limit).
- `#SBATCH --requeue`: Slurm may requeue the job on a node failure or preemption too.
- `#SBATCH --open-mode=append`: the requeued job appends to the same log.

The requeued job runs the same script from the top, and main.py resumes from the
checkpoint (step, weights, optimizer, data position); a run that finished does
nothing more. The grace must cover one host call (`Trainer.steps_per_loop` steps)
plus one checkpoint; 120 s is ample for ResNet-50 at 100 steps per loop.

Only the shell runs here: this module builds text and imports nothing from TensorFlow.
"""

import os
import shlex
import sys
from typing import List, Sequence

DEFAULT_GRACE_S = 120


def sbatch_lines(grace_s: int = DEFAULT_GRACE_S) -> List[str]:
    """The `#SBATCH` lines of the recipe: requeue, the warning signal, an appended log."""
    if not isinstance(grace_s, int) or grace_s < 1:
        raise ValueError(f"the warning's grace must be a positive number of seconds, got {grace_s!r}")
    return ["#SBATCH --requeue", f"#SBATCH --signal=B:TERM@{grace_s}", "#SBATCH --open-mode=append"]


def run_and_requeue(run: str) -> List[str]:
    """Bash lines that run `run` (a shell command line) in the background, forward the
    warning SIGTERM to it, wait for it, requeue the job if warned, and exit with its status.

    `set +e` first: `wait` returns non-zero when the trap interrupts it."""
    return [
        "set +e",
        "# Slurm's warning (SIGTERM to this shell) goes on to the run, which checkpoints and exits;",
        "# then the job is requeued, and the requeued job resumes from that checkpoint.",
        'warned=""; run_pid=""',
        "trap 'warned=1; echo \"expframe: SIGTERM from Slurm: the run checkpoints and exits, then the job "
        "is requeued\"; [ -n \"$run_pid\" ] && kill -TERM \"$run_pid\" 2>/dev/null' TERM",
        f"{run} &",
        "run_pid=$!",
        '[ -n "$warned" ] && kill -TERM "$run_pid" 2>/dev/null  # warned before the run started',
        'while kill -0 "$run_pid" 2>/dev/null; do wait "$run_pid"; done',
        'wait "$run_pid"; status=$?',
        'if [ -n "$warned" ]; then',
        '  job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"; job="${job:-${SLURM_JOB_ID:-}}"',
        '  echo "expframe: the run exited with status $status; requeueing job $job"',
        '  scontrol requeue "$job" || echo "expframe: scontrol requeue $job failed; resubmit this script '
        'to resume" >&2',
        "fi",
        'exit "$status"',
    ]


def _job_name(command: Sequence[str]) -> str:
    for arg in command:
        if arg.startswith("--gin_file="):
            return os.path.splitext(os.path.basename(arg.split("=", 1)[1]))[0] or "expframe"
    return "expframe"


def single_run_script(command: Sequence[str], tasks: int, options: Sequence[str] = (),
                      grace_s: int = DEFAULT_GRACE_S) -> str:
    """A batch script that runs `command` as one Slurm job step of `tasks` tasks.

    Args:
      command: the program and its arguments (`main.py ...`: a first word ending in
        `.py` runs with `$PYTHON`, default this Python).
      tasks: Slurm tasks, one worker each (`Replicator.target='multi_worker'` takes the
        cluster from the job step's SLURM_* variables; one task runs any target).
      options: extra `#SBATCH` options, e.g. `--partition=gpu`, `--nodes=4`, `--time=24:00:00`.
      grace_s: seconds before the time limit when Slurm warns the run.

    Returns:
      The script's text, for `sbatch`.
    """
    command = list(command)
    python = command[0].endswith(".py")
    argv = " ".join(shlex.quote(a) for a in command)
    lines = [
        "#!/bin/bash",
        f"# One expframe run on Slurm: {tasks} task(s), one worker each. Written by "
        "`python -m expframe.launch --emit=slurm`; submit with `sbatch <this file>`.",
        f"# {grace_s} s before the time limit the run checkpoints "
        "and exits, and the job is requeued; the requeued job resumes from that checkpoint.",
        f"#SBATCH --job-name={_job_name(command)}",
        f"#SBATCH --ntasks={tasks}",
    ]
    lines += sbatch_lines(grace_s)
    lines += [f"#SBATCH {option}" for option in options]
    lines += [
        f"cd {shlex.quote(os.getcwd())}",
        f"PYTHON=\"${{PYTHON:-{sys.executable}}}\"",
        f"ARGS=({argv})",
        'echo "expframe: Slurm job ${SLURM_JOB_ID:-?}, requeued ${SLURM_RESTART_COUNT:-0} time(s): ${ARGS[*]}"',
    ]
    run = 'srun --kill-on-bad-exit=1 ' + ('"$PYTHON" "${ARGS[@]}"' if python else '"${ARGS[@]}"')
    return "\n".join(lines + run_and_requeue(run)) + "\n"
