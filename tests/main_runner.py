"""Runs main.py as a user does, in a subprocess, with small shared test data."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "main.py")

# Shrinks any shapes-based experiment to seconds.
SMALL = ("resnet.depth = 8", "shapes_input.num_train = 512", "shapes_input.num_test = 64",
         "Trainer.global_batch_size = 16", "Trainer.train_steps = 6", "Trainer.steps_per_loop = 2",
         "Trainer.log_every_steps = 2", "Trainer.eval_every_steps = None", "Trainer.eval_steps = 2",
         "Trainer.checkpoint_every_steps = 4")
# For tests whose point is not the replicas: one replica traces the step in half the time.
ONE_REPLICA = ("Replicator.num_replicas = 1",)


def build_shapes(data_dir) -> None:
    """The small shapes build (512 train / 64 test images of 32 px) that SMALL reads."""
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    for split in ("train", "test"):
        shapes.load_shapes(split, size=32, data_dir=str(data_dir), num_train=512, num_test=64)


def env(data_dir):
    e = dict(os.environ, TFDS_DATA_DIR=str(data_dir), TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    e.pop("TF_CONFIG", None)
    return e


def args(gin_files, model_dir, params=(), extra=()):
    out = [sys.executable, MAIN] + [f"--gin_file={g}" for g in gin_files]
    out += [f"--gin_param={p}" for p in params] + list(extra)
    if model_dir is not None:
        out.append(f"--model_dir={model_dir}")
    return out


def run(gin_files, model_dir, data_dir, params=(), extra=(), timeout=300):
    return subprocess.run(args(gin_files, model_dir, params, extra), cwd=ROOT, env=env(data_dir),
                          capture_output=True, text=True, timeout=timeout)


def start(gin_files, model_dir, data_dir, params=(), extra=()):
    return subprocess.Popen(args(gin_files, model_dir, params, extra), cwd=ROOT, env=env(data_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(model_dir, split=None):
    """metrics.jsonl's records of one split, or of every split but "provenance" (what
    each process start ran on, which differs between runs)."""
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["split"] == split or (split is None and r["split"] != "provenance")]


def wait_for_line(proc, needle, timeout=240):
    """Reads proc's output until a line contains needle; returns the lines read."""
    import select  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never appeared; output:\n{''.join(lines)}")


def proc_state(pid):
    """(state letter, parent pid) of a process from /proc/<pid>/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def child_pids(parent, zombies=False):
    """The pids whose parent is `parent`, sorted; zombies (exited, not reaped) only if asked."""
    pids = []
    for entry in os.listdir("/proc"):
        state = proc_state(entry) if entry.isdigit() else None
        if state is not None and state[1] == parent and (zombies or state[0] != "Z"):
            pids.append(int(entry))
    return sorted(pids)


def latest_step(model_dir):
    """The step of model_dir's newest checkpoint (checkpoints/ckpt-<step>)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return int(tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")).rsplit("-", 1)[1])
