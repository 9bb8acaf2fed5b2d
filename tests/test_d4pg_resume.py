"""D4PG acting in the learner's process resumes exactly (docs/d4pg.md, docs/stopping.md): a
deterministic run stopped by SIGTERM at one step and again at another, then SIGKILLed (it
resumes from its last periodic checkpoint), ends as the run never stopped does, from state
features (experiments/d4pg_control.gin) and from pixels (experiments/d4pg_control_pixels.gin):

* every train and eval record of metrics.jsonl has the same numbers, float for float (the
  learner's and the actor's speeds, `*_per_sec`, aside: they are wall-clock rates);
* every tensor of the final checkpoint is the same, the acting state's bytes (replay,
  the episode in progress, the environment's physics and random state, the noise) included
  (`save_counter` aside: it counts checkpoint writes, one more per stop).

The stops land inside episodes and an episode ends between the two SIGTERMs (episodes of
40 environment steps, 4 environment steps per learner step, at least 10 learner steps
between them). The uninterrupted runs come from a module fixture, each started beside its
test's own runs; each test runs 4 processes on one model_dir: SIGTERM, SIGTERM, SIGKILL,
then to the end."""

import io
import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from tests import main_runner as mr

STATES_GIN = "experiments/d4pg_control.gin"
PIXELS_GIN = "experiments/d4pg_control_pixels.gin"
TRAIN_STEPS = 30
CHECKPOINT_EVERY = 5
# The shared shape: 1 replica, deterministic ops, one learner step per host call, a record
# per step, an evaluation every 10 steps (its environment is reseeded from (seed, step)).
COMMON = mr.ONE_REPLICA + (
    "run_experiment.deterministic = True", "Trainer.global_batch_size = 16",
    f"Trainer.train_steps = {TRAIN_STEPS}", "Trainer.steps_per_loop = 1", "Trainer.log_every_steps = 1",
    "Trainer.eval_every_steps = 10", f"Trainer.checkpoint_every_steps = {CHECKPOINT_EVERY}",
    "control_suite.action_repeat = 25", "D4PGTask.samples_per_insert = 4.0", "D4PGTask.eval_episodes = 1")
# tests/test_d4pg_experiments.py's SMALL on 1 replica: episodes of 40 environment steps
# (tests/test_d4pg_lockstep.py shrinks its runs the same way).
TINY_STATES = ("d4pg_policy.layer_sizes = (16, 16)", "d4pg_critic.layer_sizes = (16, 16)",
               "D4PGTask.min_replay_size = 50")
# tests/test_stop_matrix.py's PIXEL: 16x16 frames, 2 stacked, a tiny encoder.
TINY_PIXELS = ("control_suite.size = 16", "control_suite.frame_stack = 2", "drq_encoder.num_filters = 4",
               "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8", "d4pg_policy.layer_sizes = (16,)",
               "d4pg_critic.layer_sizes = (16,)", "D4PGTask.min_replay_size = 40", "D4PGTask.max_replay_size = 2000")
STATES = COMMON + TINY_STATES
PIXELS = COMMON + TINY_PIXELS
FAMILIES = {"states": (STATES_GIN, STATES), "pixels": (PIXELS_GIN, PIXELS)}
# Wall-clock rates: the only numbers a resumed run may log differently (and the first host
# call after a start, which traces the step, is left out of learner_steps_per_sec).
TIMING = re.compile(r"_per_sec$")
# Counts checkpoint writes (each stop writes one more); not state of the run.
BOOKKEEPING = ("save_counter/.ATTRIBUTES/VARIABLE_VALUE",)
ACTING = "acting/.ATTRIBUTES/py_state"

_SAVED = re.compile(r"received SIGTERM at step (\d+): checkpoint saved")
_RESUMED = re.compile(r"resuming from step (\d+)")
_STEP = re.compile(r"^step (\d+)/")


class _Run:
    """main.py in a subprocess, its output read by a thread; waits for a progress line."""

    def __init__(self, gin_file, params, model_dir, data_dir):
        self.proc = subprocess.Popen(mr.args([gin_file], model_dir, params), cwd=mr.ROOT, env=mr.env(data_dir),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        self.lines, self._step, self._seen = [], 0, threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                found = _STEP.match(line)
                if found:
                    self._step = int(found[1])
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for_step(self, step, timeout=300.0):
        """Returns once the progress line of `step` (or a later one) was printed."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while self._step < step:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"the run ended before step {step}:\n{self.output()[-3000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no step {step} within {timeout} s:\n{self.output()[-3000:]}")
                self._seen.wait(1.0)

    def finish(self, timeout=300.0):
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10.0)
        return code

    def output(self):
        return "\n".join(self.lines)

    def found(self, pattern):
        return [int(m[1]) for m in map(pattern.search, self.lines) if m]


def _records(model_dir):
    """(split, step) -> the record's numbers, timing aside, for train and eval records."""
    out = {}
    for record in mr.metrics(model_dir):
        if record["split"] in ("train", "eval"):
            key = (record["split"], record["step"])
            assert key not in out, f"{key} logged twice"
            out[key] = {k: v for k, v in record.items() if not TIMING.search(k)}
    return out


def _tensors(model_dir):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    path = os.path.join(model_dir, "checkpoints", f"ckpt-{TRAIN_STEPS}")
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map() if name not in BOOKKEEPING}


def _acting_arrays(blob):
    with np.load(io.BytesIO(blob), allow_pickle=False) as arrays:
        return {k: arrays[k] for k in arrays.files}


def _assert_same_run(model_dir, reference, stops):
    got, expected = _records(model_dir), _records(reference)
    assert sorted(got) == sorted(expected), (sorted(set(got) ^ set(expected)))
    assert [s for split, s in sorted(expected) if split == "train"] == list(range(1, TRAIN_STEPS + 1))
    assert {s for split, s in expected if split == "eval"} == set(range(10, TRAIN_STEPS + 1, 10))
    differ = [(key, name, got[key].get(name), value)
              for key, record in sorted(expected.items(), key=lambda item: (item[0][1], item[0][0]))
              for name, value in record.items() if got[key].get(name) != value]
    assert not differ, (f"{len(differ)} numbers differ from the uninterrupted run's, from {differ[0][0]} on "
                        f"(stops: {stops}); the first (record, name, resumed, uninterrupted): {differ[:4]}")
    assert all(got[key].keys() == expected[key].keys() for key in expected)
    # Episodes ended and were continued across the stops (not only learning from a replay).
    assert expected[("train", TRAIN_STEPS)]["episodes"] >= 3
    tensors, reference_tensors = _tensors(model_dir), _tensors(reference)
    assert tensors.keys() == reference_tensors.keys()
    assert ACTING in tensors
    for name, value in reference_tensors.items():
        if name == ACTING and tensors[name] != value:
            a, b = _acting_arrays(tensors[name]), _acting_arrays(value)
            assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
            raise AssertionError(f"acting state differs in {[k for k in a if not np.array_equal(a[k], b[k])]}")
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    return len(expected), len(tensors)


class _References:
    """The uninterrupted run of each observation kind: started on first use (beside the
    test's own runs), waited for when compared against."""

    def __init__(self, root):
        self._root, self._runs, self._codes = root, {}, {}

    def start(self, family):
        if family not in self._runs:
            gin_file, params = FAMILIES[family]
            self._runs[family] = _Run(gin_file, params, self._root / family, self._root)

    def model_dir(self, family):
        self.start(family)
        run = self._runs[family]
        if family not in self._codes:
            self._codes[family] = run.finish(timeout=600)
        assert self._codes[family] == 0, run.output()[-3000:]
        return self._root / family

    def close(self):
        for run in self._runs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    runs = _References(tmp_path_factory.mktemp("reference"))
    try:
        yield runs
    finally:
        runs.close()


def _stop(run, step, how):
    run.wait_for_step(step)
    run.proc.send_signal(how)
    return run.finish()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sigterm_twice_then_sigkill_resumes_as_the_run_never_stopped(family, references, tmp_path):
    gin_file, params = FAMILIES[family]
    references.start(family)   # beside this test's runs
    model_dir = tmp_path / "run"
    started = time.monotonic()

    # Each signal goes right after a progress line, with steps to spare before the run's end.
    first = _Run(gin_file, params, model_dir, tmp_path)
    assert _stop(first, 2, signal.SIGTERM) == 0, first.output()[-3000:]
    saved = first.found(_SAVED)
    assert len(saved) == 1, first.output()[-3000:]
    stopped = saved[0]

    second = _Run(gin_file, params, model_dir, tmp_path)
    assert _stop(second, stopped + 10, signal.SIGTERM) == 0, second.output()[-3000:]
    assert second.found(_RESUMED) == [stopped], second.output()[-3000:]
    saved = second.found(_SAVED)
    assert len(saved) == 1 and saved[0] >= stopped + 10, second.output()[-3000:]
    stopped_again = saved[0]

    # SIGKILL after the next periodic checkpoint: the resume starts there, not where it died.
    periodic = (stopped_again // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
    assert periodic + 10 <= TRAIN_STEPS
    third = _Run(gin_file, params, model_dir, tmp_path)
    assert _stop(third, periodic + 1, signal.SIGKILL) == -signal.SIGKILL, third.output()[-3000:]
    assert third.found(_RESUMED) == [stopped_again]

    last = _Run(gin_file, params, model_dir, tmp_path)
    assert last.finish() == 0, last.output()[-3000:]
    (resumed,) = last.found(_RESUMED)
    assert resumed % CHECKPOINT_EVERY == 0 and stopped_again < resumed < TRAIN_STEPS, (resumed, stopped_again)
    took = time.monotonic() - started

    records, tensors = _assert_same_run(model_dir, references.model_dir(family), (stopped, stopped_again, resumed))
    print(f"\n{family}: SIGTERM at step {stopped}, SIGTERM at step {stopped_again}, SIGKILL after step "
          f"{periodic + 1} (resumed from the periodic checkpoint at step {resumed}): all {records} records and "
          f"{tensors} checkpoint tensors equal to the uninterrupted run's ({took:.0f} s)")
