"""D4PG with actor processes repeats when asked (docs/d4pg.md, "Actor processes in
lockstep"): two runs with `run_experiment.deterministic = True` and the same actors, started
at the same time so that they compete for the cores and their timings differ, log the same
numbers (wall-clock figures aside) and end with the same checkpoint tensors: 1 actor process
against 1, and 2 against 2. And such a run stopped by SIGTERM twice, then SIGKILLed, resumes
as if it never stopped, its acting state's bytes (the actors' states) included."""

import os
import re
import signal
import subprocess

import numpy as np
import pytest

from tests import main_runner as mr
from tests.test_d4pg_resume import TINY_PIXELS, TINY_STATES, _Run

STATES_GIN = "experiments/d4pg_control.gin"
PIXELS_GIN = "experiments/d4pg_control_pixels.gin"
TRAIN_STEPS = 40
# Tiny networks, 40-step episodes, 4 host calls of 10 learner steps, chunks of 10
# environment steps (2 episodes end inside each actor's first 100 steps).
COMMON = mr.ONE_REPLICA + (
    "run_experiment.deterministic = True", "Trainer.global_batch_size = 32", f"Trainer.train_steps = {TRAIN_STEPS}",
    "Trainer.steps_per_loop = 10", "Trainer.log_every_steps = 10", "Trainer.eval_every_steps = 20",
    f"Trainer.checkpoint_every_steps = {TRAIN_STEPS}", "control_suite.action_repeat = 25",
    "D4PGTask.samples_per_insert = 8.0", "D4PGTask.eval_episodes = 1", "D4PGTask.weights_every = 10")
STATES = COMMON + TINY_STATES
PIXELS = COMMON + TINY_PIXELS
# Wall-clock figures: the only numbers two runs may log differently.
TIMING = re.compile(r"_per_sec$|^learner_wait_s$|^actor_startup_s$")
BOOKKEEPING = ("save_counter/.ATTRIBUTES/VARIABLE_VALUE",)


def _records(model_dir):
    return [{k: v for k, v in r.items() if not TIMING.search(k)} for r in mr.metrics(model_dir)
            if r["split"] in ("train", "eval")]


def _tensors(model_dir):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints", f"ckpt-{TRAIN_STEPS}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map() if name not in BOOKKEEPING}


def _two_runs_at_once(tmp_path, gin_file, params):
    """Starts the same run twice at once on 2 model dirs; returns them once both ended."""
    dirs = [tmp_path / "first", tmp_path / "second"]
    procs = [subprocess.Popen(mr.args([gin_file], d, params), cwd=mr.ROOT, env=mr.env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
             for d in dirs]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
        assert "act in lockstep with the learner" in output, output[-2000:]
        # The actor processes' TensorFlow start-up notices stay out of the learner's output.
        assert not [line for line in output.splitlines() if "cuInit" in line or "absl::InitializeLog" in line
                    or "cpu_feature_guard" in line], output[-3000:]
    return dirs


def _assert_same(first, second, actors):
    records, again = _records(first), _records(second)
    assert [(r["split"], r["step"]) for r in records] == [("train", s) for s in (10, 20)] + [("eval", 20)] + [
        ("train", s) for s in (30, 40)] + [("eval", 40)]
    differ = [(a["split"], a["step"], k, a[k], b.get(k)) for a, b in zip(records, again, strict=True)
              for k in a if b.get(k) != a[k]]
    assert not differ, f"{len(differ)} numbers differ; the first (split, step, name, first, second): {differ[:4]}"
    last = [r for r in records if r["split"] == "train"][-1]
    assert last["actors_alive"] == actors and last["actor_restarts"] == 0
    # Every chunk after the first host call was acted with weights exactly one call old.
    assert last["max_weights_version_lag"] == 10 and last["weight_lag_9to16"] > 0
    assert last["replay_size"] > 50 and any("train_episode_return" in r for r in records)
    # The actor processes' episodes are counted (each reported with its return).
    episodes = [r["episodes"] for r in records if r["split"] == "train"]
    assert episodes == sorted(episodes) and episodes[-1] >= 2 * actors, episodes
    tensors, tensors_again = _tensors(first), _tensors(second)
    assert tensors.keys() == tensors_again.keys() and len(tensors) > 20
    for name, value in tensors.items():
        np.testing.assert_array_equal(tensors_again[name], value, err_msg=name)


# 2 actors is slow (the default suite's time limit; about 40 s on 2 quiet cores):
#   python -m pytest -m slow tests/test_d4pg_lockstep.py
@pytest.mark.parametrize("actors", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_deterministic_runs_with_actor_processes_are_equal(actors, tmp_path):
    first, second = _two_runs_at_once(tmp_path, STATES_GIN, STATES + (f"D4PGTask.num_actors = {actors}",))
    _assert_same(first, second, actors)


@pytest.mark.slow  # pixels: 4 processes with render workers, about 90 s on 2 cores
def test_two_deterministic_pixel_runs_with_two_actors_in_one_process_are_equal(tmp_path):
    params = PIXELS + ("D4PGTask.num_actors = 2", "D4PGTask.actors_per_process = 2")
    first, second = _two_runs_at_once(tmp_path, PIXELS_GIN, params)
    _assert_same(first, second, 2)


def test_a_lockstep_run_stopped_twice_and_killed_resumes_as_if_never_stopped(tmp_path):
    """Host calls of 5 learner steps, a checkpoint every 10: SIGTERM after step 5 (a
    checkpoint where the run stands), SIGTERM again at least 5 steps later, SIGKILL after
    the next step past the next periodic checkpoint (resumes from it), then to the end."""
    params = tuple(p for p in STATES if not p.startswith(("Trainer.steps_per_loop", "Trainer.log_every_steps",
                                                           "Trainer.checkpoint_every_steps"))) + (
        "Trainer.steps_per_loop = 5", "Trainer.log_every_steps = 5", "Trainer.checkpoint_every_steps = 10",
        "D4PGTask.num_actors = 1")
    reference = _Run(STATES_GIN, params, tmp_path / "reference", tmp_path)
    model_dir, stops, runs = tmp_path / "stopped", [], [reference]
    try:
        for how, after in ((signal.SIGTERM, 5), (signal.SIGTERM, None), (signal.SIGKILL, None)):
            resumed = mr.latest_step(model_dir) if (model_dir / "checkpoints").is_dir() else 0
            run = _Run(STATES_GIN, params, model_dir, tmp_path)
            runs.append(run)
            if after is None:   # the step after the next periodic checkpoint past where it resumed
                after = (resumed // 10 + 1) * 10 + 5 if how == signal.SIGKILL else resumed + 5
            run.wait_for_step(after)
            run.proc.send_signal(how)
            code = run.finish()
            assert code == (-signal.SIGKILL if how == signal.SIGKILL else 0), run.output()[-3000:]
            stops.append((how.name, after, mr.latest_step(model_dir)))
            assert mr.latest_step(model_dir) < TRAIN_STEPS, f"stopped too late to test a resume: {stops}"
        final = _Run(STATES_GIN, params, model_dir, tmp_path)
        runs.append(final)
        assert final.finish() == 0, final.output()[-3000:]
        assert "this resume is not exact" not in final.output()
        assert reference.finish() == 0, reference.output()[-3000:]
    finally:
        for started in runs:
            if started.proc.poll() is None:
                started.proc.kill()
    records, expected = _records(model_dir), _records(tmp_path / "reference")
    assert [(r["split"], r["step"]) for r in records] == [(r["split"], r["step"]) for r in expected]
    differ = [(a["split"], a["step"], k, a[k], b.get(k)) for a, b in zip(expected, records, strict=True)
              for k in a if b.get(k) != a[k]]
    assert not differ, f"{len(differ)} numbers differ after stops {stops}; the first: {differ[:4]}"
    tensors, reference_tensors = _tensors(model_dir), _tensors(tmp_path / "reference")
    assert tensors.keys() == reference_tensors.keys()
    for name, value in reference_tensors.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=f"{name} after stops {stops}")


@pytest.mark.slow  # about 60 s on 2 cores: two runs side by side, one of them restarting its actor
def test_a_lockstep_actor_killed_and_restarted_continues_as_if_it_never_died(tmp_path):
    """Two runs started at once, 1 actor each; in one the actor process is SIGKILLed after
    the learner's step 10: it is restarted from the state it sent with its last chunk, and
    the run logs the numbers (the restart count aside) and ends with the tensors of the
    run whose actor never died."""
    params = STATES + ("D4PGTask.num_actors = 1",)
    reference = _Run(STATES_GIN, params, tmp_path / "reference", tmp_path)
    run = _Run(STATES_GIN, params, tmp_path / "restarted", tmp_path)
    try:
        run.wait_for_step(10)
        pids = [int(m[1]) for m in map(re.compile(r"actor 0 \(pid (\d+)\) ready after").search, run.lines) if m]
        os.kill(pids[0], signal.SIGKILL)
        assert run.finish() == 0, run.output()[-3000:]
        assert reference.finish() == 0, reference.output()[-3000:]
    finally:
        for started in (reference, run):
            if started.proc.poll() is None:
                started.proc.kill()
    assert "continues from the state sent with its last chunk" in run.output(), run.output()[-3000:]
    records = _records(tmp_path / "restarted")
    assert records[-2]["actor_restarts"] == 1
    for record in records + (expected := _records(tmp_path / "reference")):
        record.pop("actor_restarts", None)
    assert records == expected
    tensors, reference_tensors = _tensors(tmp_path / "restarted"), _tensors(tmp_path / "reference")
    for name, value in reference_tensors.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
