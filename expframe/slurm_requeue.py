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

With `python -m expframe.launch --emit=slurm --evaluator`, a sidecar evaluator
(`--mode=continuous_eval`) runs as a job step of its own beside the training's: warned
too, waited for once the training finished, never the job's exit status. With
`--data_service_workers=K`, K tf.data service shards run as a job step of their own,
started first: each writes its host:port into a directory beside the job's submission
directory, the training step gets them in `$EXPFRAME_DATA_SERVICE`, and they are stopped
when the script exits (a requeued job starts new ones: they hold no state).

The requeued job runs the same script from the top, and main.py resumes from the
checkpoint (step, weights, optimizer, data position); a run that finished does
nothing more. The grace must cover one host call (`Trainer.steps_per_loop` steps)
plus one checkpoint; 120 s is ample for ResNet-50 at 100 steps per loop.

Only the shell runs here: this module builds text and imports nothing from TensorFlow.
"""

import math
import os
import shlex
import sys
from typing import List, Optional, Sequence

DEFAULT_GRACE_S = 120
DEFAULT_EVALUATOR_WAIT_S = 600  # as expframe/launch.py's --evaluator_wait_s
# The evaluator's TF_CONFIG (TensorFlow's convention: task `evaluator`, not in the cluster
# spec). On Slurm the training tasks take their cluster from their job step's SLURM_*
# variables, not from TF_CONFIG, so there is no cluster to name; the evaluator needs none.
EVALUATOR_TF_CONFIG = '{"cluster": {}, "task": {"type": "evaluator", "index": 0}}'


def sbatch_lines(grace_s: int = DEFAULT_GRACE_S) -> List[str]:
    """The `#SBATCH` lines of the recipe: requeue, the warning signal, an appended log."""
    if not isinstance(grace_s, int) or grace_s < 1:
        raise ValueError(f"the warning's grace must be a positive number of seconds, got {grace_s!r}")
    return ["#SBATCH --requeue", f"#SBATCH --signal=B:TERM@{grace_s}", "#SBATCH --open-mode=append"]


def run_and_requeue(run: str, evaluator: Optional[str] = None,
                    evaluator_wait_s: int = DEFAULT_EVALUATOR_WAIT_S) -> List[str]:
    """Bash lines that run `run` (a shell command line) in the background, forward the
    warning SIGTERM to it, wait for it, requeue the job if warned, and exit with its status.

    `evaluator` (a shell command line, optional) runs beside it as a sidecar: warned
    too; once `run` exited 0 it is waited for up to `evaluator_wait_s` seconds (it
    evaluates the final checkpoint and exits), then stopped with SIGTERM; when `run`
    failed it is stopped at once. Its status is said in one line if not 0, and is never
    the script's.

    `set +e` first: `wait` returns non-zero when the trap interrupts it."""
    pids = '"$run_pid"' + (' "$eval_pid"' if evaluator else "")
    lines = [
        "set +e",
        "# Slurm's warning (SIGTERM to this shell) goes on to the run, which checkpoints and exits;",
        "# then the job is requeued, and the requeued job resumes from that checkpoint.",
        'warned=""; run_pid=""' + ('; eval_pid=""' if evaluator else ""),
        "trap 'warned=1; echo \"expframe: SIGTERM from Slurm: the run checkpoints and exits, then the job "
        "is requeued\"; [ -n \"$run_pid\" ] && kill -TERM \"$run_pid\" 2>/dev/null"
        + ("; [ -n \"$eval_pid\" ] && kill -TERM \"$eval_pid\" 2>/dev/null" if evaluator else "") + "' TERM",
        f"{run} &",
        "run_pid=$!",
    ]
    if evaluator:
        lines += ["# The evaluator, a job step of its own: it evaluates each checkpoint as it appears.",
                  f"{evaluator} &", "eval_pid=$!"]
    lines += [
        f'[ -n "$warned" ] && kill -TERM {pids} 2>/dev/null  # warned before the run started',
        'while kill -0 "$run_pid" 2>/dev/null; do wait "$run_pid"; done',
        'wait "$run_pid"; status=$?',
    ]
    if evaluator:
        lines += [
            "# A finished training leaves the evaluator its final checkpoint (bounded wait); a failed",
            "# or warned one stops it. The evaluator's status is never the job's.",
            'if [ "$status" -eq 0 ] && [ -z "$warned" ]; then',
            "  waited=0",
            f'  while kill -0 "$eval_pid" 2>/dev/null && [ -z "$warned" ] && [ "$waited" -lt {evaluator_wait_s} ]; do',
            "    sleep 1; waited=$((waited + 1))",
            "  done",
            '  if kill -0 "$eval_pid" 2>/dev/null && [ -z "$warned" ]; then',
            f'    echo "expframe: the evaluator had not finished {evaluator_wait_s} s after the training; stopped it '
            'with SIGTERM"',
            '    kill -TERM "$eval_pid" 2>/dev/null',
            "  fi",
            "else",
            '  kill -TERM "$eval_pid" 2>/dev/null',
            "fi",
            'while kill -0 "$eval_pid" 2>/dev/null; do wait "$eval_pid"; done',
            'wait "$eval_pid"; eval_status=$?',
            '[ "$eval_status" -ne 0 ] && echo "expframe: the evaluator exited with status $eval_status; the job\'s '
            'status is the training\'s ($status)"',
        ]
    return lines + [
        'if [ -n "$warned" ]; then',
        '  job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"; job="${job:-${SLURM_JOB_ID:-}}"',
        '  echo "expframe: the run exited with status $status; requeueing job $job"',
        '  scontrol requeue "$job" || echo "expframe: scontrol requeue $job failed; resubmit this script '
        'to resume" >&2',
        "fi",
        'exit "$status"',
    ]


def data_service_lines(shards: int, ready_timeout_s: int = 300) -> List[str]:
    """Bash lines that start `shards` tf.data service shards as a job step of their own
    (one task each, `python -m expframe.launch --serve_data_shard`), wait until every one
    wrote its host:port, export them in $EXPFRAME_DATA_SERVICE, and stop them when the
    script exits."""
    return [
        f"# The tf.data service: {shards} shard(s), a dispatcher and its one worker each, a job step of their own;",
        "# the training's train input is prepared there (expframe/replicator/data_service.py).",
        'SERVICE_DIR="$(mktemp -d "${SLURM_SUBMIT_DIR:-$PWD}/.expframe_data_service.XXXXXX")"',
        f"srun --ntasks={shards} --exact bash -c "
        "'exec \"$0\" -m expframe.launch --serve_data_shard --address_file=\"$1/shard_$SLURM_PROCID\"' "
        '"$PYTHON" "$SERVICE_DIR" &',
        "service_pid=$!",
        "trap 'kill -TERM \"$service_pid\" 2>/dev/null; rm -rf \"$SERVICE_DIR\"' EXIT",
        "waited=0",
        f'while [ "$(ls "$SERVICE_DIR" | grep -c \'^shard_[0-9]*$\')" -lt {shards} ]; do',
        f'  if ! kill -0 "$service_pid" 2>/dev/null || [ "$waited" -ge {ready_timeout_s} ]; then',
        f'    echo "expframe: the tf.data service did not start ({shards} shard(s), {ready_timeout_s} s); '
        'nothing else was started" >&2; exit 1',
        "  fi",
        "  sleep 1; waited=$((waited + 1))",
        "done",
        'export EXPFRAME_DATA_SERVICE="$(cat "$SERVICE_DIR"/shard_* | paste -sd, -)"',
        'echo "expframe: tf.data service at $EXPFRAME_DATA_SERVICE"',
    ]


def _job_name(command: Sequence[str]) -> str:
    for arg in command:
        if arg.startswith("--gin_file="):
            return os.path.splitext(os.path.basename(arg.split("=", 1)[1]))[0] or "expframe"
    return "expframe"


def single_run_script(command: Sequence[str], tasks: int, options: Sequence[str] = (),
                      grace_s: int = DEFAULT_GRACE_S, evaluator_command: Optional[Sequence[str]] = None,
                      evaluator_wait_s: float = DEFAULT_EVALUATOR_WAIT_S, data_service_workers: int = 0) -> str:
    """A batch script that runs `command` as one Slurm job step of `tasks` tasks.

    With `evaluator_command` (the command with `--mode=continuous_eval`, from
    `expframe.launch.evaluator_command`) the job has one task more, and the evaluator
    runs as a job step of its own, one task, beside the training's (`--exact`: each
    step has the CPUs of its own tasks, `--cpus-per-task` each), with the TF_CONFIG of
    an `evaluator` task (`EVALUATOR_TF_CONFIG`); see `run_and_requeue`.

    Args:
      command: the program and its arguments (`main.py ...`: a first word ending in
        `.py` runs with `$PYTHON`, default this Python).
      tasks: Slurm tasks, one worker each (`Replicator.target='multi_worker'` takes the
        cluster from the job step's SLURM_* variables; one task runs any target).
      options: extra `#SBATCH` options, e.g. `--partition=gpu`, `--nodes=4`, `--time=24:00:00`.
      grace_s: seconds before the time limit when Slurm warns the run.
      evaluator_command: the sidecar evaluator's command, or None for none.
      evaluator_wait_s: how long a finished training waits for the evaluator.
      data_service_workers: tf.data service shards, K tasks more, as a job step started
        first (`data_service_lines`).

    Returns:
      The script's text, for `sbatch`.
    """
    command = list(command)
    python = command[0].endswith(".py")
    argv = " ".join(shlex.quote(a) for a in command)
    evaluator = "" if evaluator_command is None else ", and 1 evaluator task (--mode=continuous_eval)"
    lines = [
        "#!/bin/bash",
        f"# One expframe run on Slurm: {tasks} task(s), one worker each{evaluator}. Written by "
        "`python -m expframe.launch --emit=slurm`; submit with `sbatch <this file>`.",
        f"# {grace_s} s before the time limit the run checkpoints "
        "and exits, and the job is requeued; the requeued job resumes from that checkpoint.",
        f"#SBATCH --job-name={_job_name(command)}",
        f"#SBATCH --ntasks={tasks + (evaluator_command is not None) + data_service_workers}",
    ]
    lines += sbatch_lines(grace_s)
    lines += [f"#SBATCH {option}" for option in options]
    lines += [
        f"cd {shlex.quote(os.getcwd())}",
        f"PYTHON=\"${{PYTHON:-{sys.executable}}}\"",
        f"ARGS=({argv})",
    ]
    if evaluator_command is not None:
        lines.append(f"EVAL_ARGS=({' '.join(shlex.quote(a) for a in evaluator_command)})")
    lines.append('echo "expframe: Slurm job ${SLURM_JOB_ID:-?}, requeued ${SLURM_RESTART_COUNT:-0} time(s): '
                 '${ARGS[*]}"')
    program = '"$PYTHON" "${ARGS[@]}"' if python else '"${ARGS[@]}"'
    if data_service_workers:
        lines += data_service_lines(data_service_workers)
    if evaluator_command is None:
        exact = f"--ntasks={tasks} --exact " if data_service_workers else ""
        return "\n".join(lines + run_and_requeue(f"srun {exact}--kill-on-bad-exit=1 " + program)) + "\n"
    run = f"srun --ntasks={tasks} --exact --kill-on-bad-exit=1 {program}"
    sidecar = (f"TF_CONFIG={shlex.quote(EVALUATOR_TF_CONFIG)} srun --ntasks=1 --nodes=1 --exact "
               + ('"$PYTHON" "${EVAL_ARGS[@]}"' if evaluator_command[0].endswith(".py") else '"${EVAL_ARGS[@]}"'))
    wait_s = max(1, math.ceil(evaluator_wait_s))
    return "\n".join(lines + run_and_requeue(run, sidecar, wait_s)) + "\n"
