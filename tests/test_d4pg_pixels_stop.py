"""Ctrl-C to a pixel run's process group (a terminal, `timeout`, `kill -- -PGID`): the render
workers and actor processes live in sessions of their own and ignore SIGINT, so the learner
finishes its host call, saves a checkpoint at that step and exits 0; 10 s later no process
of the run's tree is left; the same command resumes from that step. (Issue 30: the render
worker died first and the learner exited 1 with no checkpoint.) The stop matrix
(tests/test_stop_matrix.py) runs the same cells in the default suite."""

import os
import re
import signal
import subprocess
import time

import pytest

from expframe import processes
from tests import main_runner as mr
from tests.test_d4pg_pixels_experiments import PIXELS, SMALL

LONG = SMALL + ("Trainer.train_steps = 100000", "Trainer.checkpoint_every_steps = 100000",
                "D4PGTask.weights_every = 20", "D4PGTask.num_actors = 1")


def _start(model_dir, data_dir):
    # A session of its own, as a terminal's job: the signal goes to the whole group.
    return subprocess.Popen(mr.args([PIXELS], model_dir, LONG), cwd=mr.ROOT, env=mr.env(data_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _interrupt(proc, after):
    """Waits for the progress line of step `after`, SIGINTs the group; (output, seconds to exit, tree)."""
    lines = mr.wait_for_line(proc, f"step {after}/100000", timeout=600)
    tree = processes.descendants(proc.pid)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    return "".join(lines) + rest, time.monotonic() - sent, tree


@pytest.mark.slow
def test_sigint_to_the_group_of_a_pixel_run_with_an_actor_checkpoints_and_resumes(tmp_path):
    model_dir = tmp_path / "run"
    proc = _start(model_dir, tmp_path)
    try:
        out, took, tree = _interrupt(proc, 4)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "render worker" not in out and "KeyboardInterrupt" not in out and "restarting" not in out, out[-3000:]
    stopped = int(re.search(r"received SIGINT at step (\d+): checkpoint saved", out)[1])
    assert stopped >= 4 and mr.latest_step(model_dir) == stopped
    # The learner's evaluation render worker, the actor, its render worker: all gone.
    assert any("expframe.rl.actor_process" in c for c in tree.values()), tree
    assert sum("expframe.rl.rendering" in c for c in tree.values()) == 2, tree
    time.sleep(10)
    left = [p for p in tree if processes.group_alive(p) or (mr.proc_state(p) or "Z")[0] != "Z"]
    assert left == [], {p: tree[p] for p in left}
    print(f"SIGINT to the group -> exit 0 in {took:.1f} s, checkpoint at step {stopped}")

    # The same command resumes from that step.
    proc = _start(model_dir, tmp_path)
    try:
        out, _, _ = _interrupt(proc, stopped + 2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and f"resuming from step {stopped}" in out, out[-3000:]
    steps = [r["step"] for r in mr.metrics(model_dir, "train")]
    assert steps == sorted(set(steps)), steps   # each step logged once
