"""The stop contract, as a matrix (docs/stopping.md): every kind of run, every way to stop it.

Rows: the quickstart, pixel D4PG in-process, pixel D4PG with 1 actor process, 2 launcher
workers, 2 launcher workers reading from 2 tf.data service shards, a 2-run study, and a
continuous evaluator beside a trainer, each shrunk to seconds. Columns: SIGINT to the
process group (a terminal's Ctrl-C, GNU `timeout`, `kill -- -PGID`), SIGTERM to the main
pid, SIGKILL to the main pid. Each cell asserts:

* the exit code (main.py 0 after its checkpoint; the launcher 128 + signal; the study 1,
  its runs not finished; -9 for SIGKILL);
* the checkpoint where promised: at the step the run names in its `received ... at
  step N: checkpoint saved` line (SIGKILL promises none: the last periodic one);
* no process of the tree alive 10 s after the signal: every pid seen below the main
  process while it ran (read from /proc every 0.1 s) and every process group they led
  (where the main process itself takes longer to checkpoint and exit, on a loaded
  machine, nothing is left 2 s after it exited);
* an exact resume: the next cell's process (the same command) resumes from that
  checkpoint, and at the end the steps in metrics.jsonl appear once each; for the
  deterministic quickstart, losses and weights equal an uninterrupted run's.

Within a row the cells run one after another on one model_dir: the process each cell
starts is the resume of the cell before (a row costs 4 process starts instead of 7),
and the last process runs to the end. Each row is one test, so xdist runs rows side by
side. The seconds from each signal to the last process gone are printed (pytest -s).
"""

import glob
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Set

import numpy as np
import pytest

from expframe import processes
from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
PIXELS = "experiments/d4pg_control_pixels.gin"
COLUMNS = ("SIGINT to the group", "SIGTERM to the main pid", "SIGKILL to the main pid")
GONE_WITHIN_S = 10.0

# 12 steps of a depth-8 ResNet on 1 replica, a checkpoint every 2 steps, no evaluation.
QUICK = mr.SMALL + mr.ONE_REPLICA + (
    "run_experiment.deterministic = True", "Trainer.train_steps = 12", "Trainer.steps_per_loop = 1",
    "Trainer.log_every_steps = 1", "Trainer.checkpoint_every_steps = 2")
# tests/test_d4pg_pixels_experiments.py's shrunk pixel run, with more steps to stop in.
PIXEL = ("control_suite.size = 16", "control_suite.action_repeat = 25", "control_suite.frame_stack = 2",
         "drq_encoder.num_filters = 4", "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8",
         "d4pg_policy.layer_sizes = (16,)", "d4pg_critic.layer_sizes = (16,)", "Trainer.global_batch_size = 16",
         "Trainer.train_steps = 12", "Trainer.steps_per_loop = 1", "Trainer.log_every_steps = 1",
         "Trainer.eval_every_steps = None", "Trainer.checkpoint_every_steps = 2", "D4PGTask.min_replay_size = 40",
         "D4PGTask.max_replay_size = 2000", "D4PGTask.samples_per_insert = 4.0", "D4PGTask.eval_episodes = 1")
MULTI_WORKER = ("Replicator.target = 'multi_worker'", "Replicator.num_replicas = None")

_STEP_LINE = re.compile(r"(^|\] )step \d+/\d+ ")
_SAVED = re.compile(r"(?:^|\] )received (SIG\w+) at step (\d+): checkpoint saved")
_RESUMED = re.compile(r"(?:^|\] )resuming from step (\d+) ")
_EVALUATED = re.compile(r"^eval at step \d+: ")
_EVAL_STOPPED = re.compile(r"^received (SIG\w+): continuous evaluation stopped after step \d+")


class _Tree:
    """A process started in a session of its own (as from a shell), its output, and every
    pid and process group seen below it while it ran."""

    def __init__(self, argv: List[str], env: Dict[str, str], ready: "re.Pattern" = _STEP_LINE):
        self._ready = ready
        self.proc = subprocess.Popen(argv, cwd=mr.ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        self.lines: List[str] = []
        self.pids: Set[int] = {self.proc.pid}
        self.pgids: Set[int] = {self.proc.pid}
        self._step = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._watching = True
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self._ready.search(line):
                self._step.set()

    def _watch(self) -> None:
        while self._watching:
            for pid in processes.descendants(self.proc.pid):
                if pid not in self.pids:
                    self.pids.add(pid)
                    try:
                        self.pgids.add(os.getpgid(pid))
                    except OSError:
                        pass
            time.sleep(0.1)

    def wait_for_training(self, timeout: float = 300.0) -> None:
        if not self._step.wait(timeout):
            raise AssertionError("no training step within the time limit:\n" + self.output()[-4000:])

    def send(self, column: str) -> float:
        """Sends the column's signal; returns when it was sent (time.monotonic)."""
        self._watching = False  # what exists is recorded; nothing new may start from here
        self._watcher.join()
        for pid in processes.descendants(self.proc.pid):  # the last look
            self.pids.add(pid)
            try:
                self.pgids.add(os.getpgid(pid))
            except OSError:
                pass
        sent = time.monotonic()
        if column == COLUMNS[0]:
            os.killpg(self.proc.pid, signal.SIGINT)
        elif column == COLUMNS[1]:
            self.proc.send_signal(signal.SIGTERM)
        else:
            self.proc.kill()
        return sent

    def stop(self, column: str):
        """Sends the column's signal and waits for the end: (exit code, seconds until the
        tree was gone or None, what was left running then)."""
        sent = self.send(column)
        gone = self.seconds_until_gone(sent)
        left = self.left()
        return self.finish(), gone, left

    def left(self) -> Dict[int, str]:
        """What of the tree still runs: pid -> command line."""
        out = {}
        for pid in self.pids:
            if processes.alive(pid):
                out[pid] = _cmdline(pid)
        live = processes.live_groups()
        for pgid in self.pgids:
            for pid in live.get(pgid, ()):
                out[pid] = _cmdline(pid)
        return out

    def seconds_until_gone(self, sent: float) -> Optional[float]:
        """Seconds from `sent` until the main process and every pid and group seen are
        gone; None if something is left 10 s after the signal (or, where the main process
        itself took longer to checkpoint and exit, 2 s after it exited)."""
        exited = None
        while True:
            now = time.monotonic()
            if exited is None and self.proc.poll() is not None:
                exited = now
            if exited is not None and not self.left():
                return now - sent
            if exited is not None and now > max(sent + GONE_WITHIN_S, exited + 2.0):
                return None
            if now - sent > 180:
                return None
            time.sleep(0.02)

    def finish(self, timeout: float = 300.0) -> int:
        self._watching = False
        code = self.proc.wait(timeout)
        self._reader.join(5.0)
        return code

    def kill_leftovers(self) -> None:
        for pid in self.left():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def output(self) -> str:
        return "\n".join(self.lines)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _checkpoint_step(model_dir) -> Optional[int]:
    """The step of model_dir's newest checkpoint, from checkpoints/checkpoint (no TensorFlow)."""
    try:
        with open(os.path.join(model_dir, "checkpoints", "checkpoint"), encoding="utf-8") as f:
            m = re.search(r'^model_checkpoint_path: ".*?(\d+)"', f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _train_steps(model_dir) -> List[int]:
    return [r["step"] for r in mr.metrics(model_dir, "train")]


def _resumed(tree: _Tree) -> List[int]:
    return [int(m.group(1)) for m in map(_RESUMED.search, tree.lines) if m]


def _run_row(name: str, argv: List[str], env: Dict[str, str], model_dirs, stopped_codes, final_code: int = 0,
             final_must_resume: bool = True):
    """Runs the row's three cells and its final resume, each the same command; asserts
    each cell; returns (final output, {column: seconds from signal to last process gone})."""
    seconds, promised, outcomes = {}, None, []
    cpu_before, wall_before = _children_cpu_s(), time.monotonic()
    for column, stopped_code in zip(COLUMNS, stopped_codes + (-signal.SIGKILL,), strict=True):
        tree = _Tree(argv, env)
        try:
            tree.wait_for_training()
            if promised:  # this process is the resume of the cell before
                assert _resumed(tree) and set(_resumed(tree)) <= promised, (column, promised, tree.output()[-3000:])
            code, gone, left = tree.stop(column)
        finally:
            tree.kill_leftovers()
        out = tree.output()
        outcomes.append((column, code, gone))
        assert gone is not None, f"{name}, {column}: left running {GONE_WITHIN_S:.0f} s after the signal: {left}"
        seconds[column] = round(gone, 2)
        assert code == stopped_code, (name, column, code, out[-3000:])
        checkpoints = {s for s in (_checkpoint_step(d) for d in model_dirs()) if s is not None}
        if column != COLUMNS[2]:  # a checkpoint at the step the run stopped at
            saved = [(m.group(1), int(m.group(2))) for m in map(_SAVED.search, tree.lines) if m]
            assert saved, (name, column, out[-3000:])
            assert {s for s, _ in saved} == {"SIGINT" if column == COLUMNS[0] else "SIGTERM"}, saved
            assert {step for _, step in saved} <= checkpoints, (saved, checkpoints)
        # SIGKILL promises no checkpoint: the resume starts from the newest periodic one.
        assert checkpoints, (name, column, out[-3000:])
        promised = checkpoints
    final = _Tree(argv, env)
    try:
        code = final.finish()
    finally:
        final.kill_leftovers()
    out = final.output()
    assert code == final_code, (name, code, out[-4000:])
    # A study's SIGKILL may land on a run that had started after the last checkpoint of any
    # run (the runs go one at a time): the final command then starts it afresh, no resume.
    assert (_resumed(final) or not final_must_resume) and set(_resumed(final)) <= promised, (promised, out[-3000:])
    print(f"\n{name}: " + "; ".join(f"{c}: exit {code}, gone {g:.2f} s" for c, code, g in outcomes)
          + f" ({_children_cpu_s() - cpu_before:.0f} s CPU, {time.monotonic() - wall_before:.0f} s wall)")
    return out, seconds


def _once_each(model_dir, train_steps: int) -> None:
    assert _train_steps(model_dir) == list(range(1, train_steps + 1)), _train_steps(model_dir)


def _weights(model_dir):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    names = sorted(n for n in reader.get_variable_to_shape_map() if n.startswith("model/"))
    assert names
    return {n: reader.get_tensor(n) for n in names}


@pytest.mark.timeout(900)
def test_quickstart(data_dir, tmp_path):
    env = mr.env(data_dir)
    model_dir = tmp_path / "run"
    reference: dict = {}
    straight = threading.Thread(target=lambda: reference.update(done=mr.run(
        [QUICKSTART], tmp_path / "straight", data_dir, QUICK, extra=["--mode=train"], timeout=400)))
    straight.start()
    _run_row("quickstart", mr.args([QUICKSTART], model_dir, QUICK, ["--mode=train"]), env, lambda: [model_dir],
             (0, 0))
    straight.join()
    assert reference["done"].returncode == 0, reference["done"].stderr[-3000:]
    _once_each(model_dir, 12)
    losses = [r["loss"] for r in mr.metrics(model_dir, "train")]
    np.testing.assert_allclose(losses, [r["loss"] for r in mr.metrics(tmp_path / "straight", "train")],
                               rtol=1e-6, atol=1e-7)
    a, b = _weights(tmp_path / "straight"), _weights(model_dir)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow  # the default suite's time limit: the row below runs the same file, its
# learner's evaluation renderer and checkpoint with an actor process (and its renderer) too.
@pytest.mark.timeout(900)
def test_pixel_d4pg_in_process(tmp_path):
    model_dir = tmp_path / "run"
    _run_row("pixel D4PG in-process", mr.args([PIXELS], model_dir, PIXEL, ["--mode=train"]), mr.env(tmp_path),
             lambda: [model_dir], (0, 0))
    _once_each(model_dir, 12)


@pytest.mark.timeout(900)
def test_pixel_d4pg_with_an_actor_process(tmp_path):
    model_dir = tmp_path / "run"
    params = PIXEL + ("D4PGTask.num_actors = 1", "D4PGTask.weights_every = 20")
    _run_row("pixel D4PG, 1 actor process", mr.args([PIXELS], model_dir, params, ["--mode=train"]),
             mr.env(tmp_path), lambda: [model_dir], (0, 0))
    _once_each(model_dir, 12)


@pytest.mark.slow  # the default suite's time limit: the row below runs the same launcher and
# workers, with the tf.data service's shards beside them.
@pytest.mark.timeout(900)
def test_two_launcher_workers(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "expframe.launch", "--workers=2", "--"]
    argv += mr.args([QUICKSTART], model_dir, QUICK + MULTI_WORKER, ["--mode=train"])[1:]
    # The launcher exits 128 + the signal it received, after its workers checkpointed.
    out, _ = _run_row("2 launcher workers", argv, mr.env(data_dir), lambda: [model_dir],
                      (128 + signal.SIGINT, 128 + signal.SIGTERM))
    assert "StartAbort" not in out
    _once_each(model_dir, 12)


@pytest.mark.timeout(900)
def test_two_launcher_workers_with_a_data_service(data_dir, tmp_path):
    """No shard outlives a cell, and the resumed runs read the uninterrupted stream: their
    losses equal one process's on 2 replicas, without the service."""
    model_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "expframe.launch", "--workers=2", "--data_service_workers=2", "--"]
    argv += mr.args([QUICKSTART], model_dir, QUICK + MULTI_WORKER, ["--mode=train"])[1:]
    reference: dict = {}
    straight = threading.Thread(target=lambda: reference.update(done=mr.run(
        [QUICKSTART], tmp_path / "straight", data_dir, QUICK + ("Replicator.num_replicas = 2",),
        extra=["--mode=train"], timeout=400)))
    straight.start()
    out, _ = _run_row("2 launcher workers, 2 data service shards", argv, mr.env(data_dir), lambda: [model_dir],
                      (128 + signal.SIGINT, 128 + signal.SIGTERM))
    straight.join()
    assert reference["done"].returncode == 0, reference["done"].stderr[-3000:]
    assert "tf.data service: 2 shard(s) at 127.0.0.1:" in out and "prepared by the tf.data service" in out
    _once_each(model_dir, 12)
    np.testing.assert_allclose([r["loss"] for r in mr.metrics(model_dir, "train")],
                               [r["loss"] for r in mr.metrics(tmp_path / "straight", "train")], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(900)
def test_two_run_study(data_dir, tmp_path):
    root = tmp_path / "study"
    argv = [sys.executable, "-m", "expframe.sweep", f"--gin_file={QUICKSTART}", f"--study_dir={root}",
            "--mode=train", "--sweep=run_experiment.seed=[0, 1]"]
    argv += [f"--gin_param={p}" for p in QUICK if not p.startswith("Trainer.train_steps")]
    argv += ["--gin_param=Trainer.train_steps = 6"]

    def run_dirs():
        return sorted(os.path.dirname(p) for p in glob.glob(str(root / "*" / "config.gin")))

    # The study exits 1 when stopped (its runs are not finished), 0 once every run is.
    _run_row("2-run study", argv, mr.env(data_dir), run_dirs, (1, 1), final_must_resume=False)
    dirs = run_dirs()
    assert len(dirs) == 2
    for d in dirs:
        _once_each(d, 6)
        assert json.loads(open(os.path.join(d, "result.json")).read())["step"] == 6


@pytest.mark.slow  # the default suite's time limit (about 80 s): tests/test_after_training.py runs the
# continuous evaluator beside a trainer (SIGKILLed mid-run and restarted) in the default tests.
@pytest.mark.timeout(900)
def test_continuous_evaluator(data_dir, tmp_path):
    """The evaluator's row: a trainer runs throughout; each cell starts `--mode=continuous_eval`
    on its model_dir, waits for an evaluation and stops it. A first SIGINT or SIGTERM ends
    it at once with one line and exit 0 (an evaluation under way is dropped); after SIGKILL
    the kernel frees its lock. The final evaluator, after the trainer stopped, evaluates
    what is left: every checkpoint's step once, in order."""
    model_dir = tmp_path / "run"
    env = mr.env(data_dir)
    params = QUICK + ("Trainer.train_steps = 100000", "Trainer.steps_per_loop = 10", "Trainer.log_every_steps = 100",
                      "Trainer.checkpoint_every_steps = 20", "Trainer.max_checkpoints = 100000")
    trainer = _Tree(mr.args([QUICKSTART], model_dir, params, ["--mode=train"]), env)
    evaluate = mr.args([QUICKSTART], model_dir, params, ["--mode=continuous_eval", "--eval_timeout_s=5"])
    outcomes = []
    try:
        trainer.wait_for_training()
        for column, stopped_code in zip(COLUMNS, (0, 0, -signal.SIGKILL), strict=True):
            tree = _Tree(evaluate, env, ready=_EVALUATED)
            try:
                tree.wait_for_training()
                code, gone, left = tree.stop(column)
            finally:
                tree.kill_leftovers()
            out = tree.output()
            outcomes.append((column, code, gone))
            assert gone is not None, f"continuous evaluator, {column}: left running: {left}"
            assert code == stopped_code, (column, code, out[-3000:])
            if column != COLUMNS[2]:
                stopped = [m.group(1) for m in map(_EVAL_STOPPED.search, tree.lines) if m]
                assert stopped == ["SIGINT" if column == COLUMNS[0] else "SIGTERM"], out[-3000:]
        trainer.proc.send_signal(signal.SIGTERM)
        assert trainer.finish() == 0, trainer.output()[-3000:]
    finally:
        trainer.kill_leftovers()
    final = _Tree(evaluate, env, ready=_EVALUATED)
    try:
        code = final.finish()
    finally:
        final.kill_leftovers()
    assert code == 0, final.output()[-3000:]
    assert "no new checkpoint in 5 s" in final.output()
    evaluated = [r["step"] for r in mr.metrics(model_dir, "eval")]
    with open(os.path.join(model_dir, "checkpoints", "checkpoint"), encoding="utf-8") as f:
        saved = sorted(int(m) for m in re.findall(r'^all_model_checkpoint_paths: ".*?(\d+)"', f.read(), re.M))
    assert evaluated == saved, (evaluated, saved)  # each checkpoint once, in step order, none skipped
    print("\ncontinuous evaluator: " + "; ".join(f"{c}: exit {code}, gone {g:.2f} s" for c, code, g in outcomes)
          + f"; {len(evaluated)} checkpoints evaluated once each")


@pytest.mark.timeout(900)
def test_a_second_trainer(data_dir, tmp_path):
    """One writer per model_dir (docs/stopping.md): two trainers started at once, and one
    started mid-run, are refused while the first trains (exit 2, one line naming the
    holder, nothing written); SIGKILL of the holder leaves no stale lock: the same command
    resumes, and every step is logged once, in order."""
    model_dir = tmp_path / "run"
    env = mr.env(data_dir)
    params = QUICK + ("Trainer.train_steps = 100000", "Trainer.steps_per_loop = 10", "Trainer.log_every_steps = 50",
                      "Trainer.checkpoint_every_steps = 50")
    argv = mr.args([QUICKSTART], model_dir, params, ["--mode=train"])
    pair = [_Tree(argv, env), _Tree(argv, env)]  # at once
    try:
        codes = {}
        while not codes:  # the refused one ends within seconds; the other trains on
            codes.update({i: t.proc.poll() for i, t in enumerate(pair) if t.proc.poll() is not None})
            time.sleep(0.2)
        refused = next(iter(codes))
        first = pair[1 - refused]
        pair[refused].finish()
        assert codes[refused] == 2, pair[refused].output()[-3000:]
        assert _holder_named(pair[refused].output(), model_dir), pair[refused].output()[-3000:]
        first.wait_for_training()
        mid = subprocess.run(argv, cwd=mr.ROOT, env=env, capture_output=True, text=True, timeout=300)  # mid-run
        assert mid.returncode == 2 and _holder_named(mid.stderr, model_dir), mid.stderr[-3000:]
        assert first.proc.poll() is None, first.output()[-3000:]
        while _checkpoint_step(model_dir) is None:
            time.sleep(0.2)
        first.send(COLUMNS[2])  # SIGKILL: the kernel frees its lock
        assert first.finish() == -signal.SIGKILL
    finally:
        for tree in pair:
            tree.kill_leftovers()
    killed_at = _checkpoint_step(model_dir)
    resumed = _Tree(argv, env)
    try:
        resumed.wait_for_training()
        resumed.send(COLUMNS[1])
        assert resumed.finish() == 0, resumed.output()[-3000:]
    finally:
        resumed.kill_leftovers()
    assert _resumed(resumed) == [killed_at], resumed.output()[-3000:]
    stopped_at = _checkpoint_step(model_dir)
    steps = _train_steps(model_dir)
    assert steps == list(range(50, stopped_at + 1, 50)), steps  # each once, in order: no second writer's


def _holder_named(text: str, model_dir) -> bool:
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    return len(lines) == 1 and re.match(
        rf"error: {re.escape(str(model_dir))} is being trained by another process \(pid \d+ on host \S+ since "
        r"\d{4}-\d\d-\d\dT", lines[0]) is not None
