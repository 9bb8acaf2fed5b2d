"""experiments/d4pg_control.gin through main.py: a shrunk run on 2 replicas and its resume,
an unknown Control Suite task (exit 2), and (slow) learning cartpole/balance to >= 800, acting
in the learner's process and with 2 actor processes (each prints its time to reach 800)."""

import json
import math
import os
import re
import threading
import time

import gin
import pytest
import tensorflow as tf

from expframe import config
from expframe.reproduce import registry
from tests import main_runner as mr

D4PG = "experiments/d4pg_control.gin"
# Seconds instead of minutes: tiny networks and batch, 8 control steps per environment
# step (cartpole episodes of 125 steps), 2 replicas to exercise the replicated learner.
SMALL = ("Replicator.num_replicas = 2", "Trainer.global_batch_size = 16", "Trainer.train_steps = 6",
         "Trainer.steps_per_loop = 3", "Trainer.log_every_steps = 3", "Trainer.eval_every_steps = None",
         "Trainer.checkpoint_every_steps = 3", "d4pg_policy.layer_sizes = (16, 16)",
         "d4pg_critic.layer_sizes = (16, 16)", "control_suite.action_repeat = 8",
         "D4PGTask.min_replay_size = 50", "D4PGTask.samples_per_insert = 4.0", "D4PGTask.eval_episodes = 1")


def test_the_experiment_binds_acmes_defaults(monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    config.parse([D4PG], [])
    try:
        expected = {"D4PGTask.n_step": 5, "D4PGTask.sigma": 0.3, "D4PGTask.discount": 0.99,
                    "Trainer.global_batch_size": 256, "d4pg_critic.num_atoms": 51, "d4pg_critic.v_min": -150.0,
                    "d4pg_critic.v_max": 150.0, "D4PGTask.target_update_period": 100,
                    "D4PGTask.samples_per_insert": 32.0, "actor/keras.optimizers.Adam.learning_rate": 1e-4,
                    "critic/keras.optimizers.Adam.learning_rate": 1e-4,
                    "actor/wrap_optimizer.clip_global_norm": 40.0, "critic/wrap_optimizer.clip_global_norm": 40.0,
                    "d4pg_policy.layer_sizes": (256, 256, 256), "control_suite.name": "cartpole/balance"}
        for binding, value in expected.items():
            assert gin.query_parameter(binding) == value, binding
    finally:
        gin.clear_config()


def _checkpoint_values(model_dir, prefix):
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    return [n for n in reader.get_variable_to_shape_map() if n.startswith(prefix)]


def test_smoke_run_on_two_replicas_and_resume(tmp_path):
    model_dir = tmp_path / "run"
    done = mr.run([D4PG], model_dir, tmp_path, SMALL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((model_dir / "result.json").read_text())
    assert (result["step"], result["num_replicas"], result["global_batch_size"]) == (6, 2, 16)
    assert 0.0 <= result["eval"]["episode_return"] <= 125.0 * 8
    train = mr.metrics(model_dir, "train")
    assert [r["step"] for r in train] == [3, 6]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["actor_loss"]) for r in train)
    # Acting kept its ratio: 50 before learning, then 16 / 4 environment steps per learner step.
    assert [r["env_steps"] for r in train] == [50 + 12, 50 + 24]
    assert train[-1]["env_steps_per_sec"] > 0 and train[-1]["learner_steps_per_sec"] > 0
    assert 0 < train[-1]["replay_size"] <= train[-1]["env_steps"]
    assert mr.metrics(model_dir, "eval")[-1]["episode_return"] == result["eval"]["episode_return"]
    operative = (model_dir / "operative_config.gin").read_text()
    assert "d4pg_critic.layer_sizes = (16, 16)" in operative and "control_suite.action_repeat = 8" in operative
    assert _checkpoint_values(model_dir, "acting/"), "the replay is not in the checkpoint"
    assert _checkpoint_values(model_dir, "target_critic/")

    # Resume to step 9: the replay and counters come back from the checkpoint at step 6.
    resumed = mr.run([D4PG], model_dir, tmp_path, SMALL + ("Trainer.train_steps = 9",),
                     extra=["--allow_config_change"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resuming from step 6" in resumed.stdout
    last = mr.metrics(model_dir, "train")[-1]
    assert (last["step"], last["env_steps"]) == (9, 50 + 36)
    # Everything replayed at step 6 is still there, plus what was acted since (the episode
    # open at the checkpoint is in it too: none of its pending n-step transitions is lost).
    assert last["replay_size"] >= train[-1]["replay_size"] + 12


def test_unknown_task_exits_2_naming_the_valid_ones(tmp_path):
    model_dir = tmp_path / "run"
    done = mr.run([D4PG], model_dir, tmp_path, ("control_suite.name = 'cartpole/balanse'",))
    assert done.returncode == 2, done.stdout + done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "control_suite.name='cartpole/balanse'" in error[0], done.stderr[-2000:]
    assert "cartpole/balance" in error[0] and "cartpole/swingup" in error[0]
    assert not model_dir.exists() or not os.listdir(model_dir)


def _timed_run(gin_files, model_dir, data_dir, params=(), timeout=3600):
    """Runs main.py, stamping each evaluation with the seconds since the start.

    Returns:
      (return code, output, [(seconds, step, episode_return)], wall seconds).
    """
    started = time.time()
    proc = mr.start(gin_files, model_dir, data_dir, params)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines, evals = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            found = re.match(r"eval at step (\d+): .*episode_return (-?[\d.]+)", line)
            if found:
                evals.append((round(time.time() - started), int(found[1]), round(float(found[2]), 1)))
        proc.wait()
    finally:
        watchdog.cancel()
    return proc.returncode, "".join(lines), evals, time.time() - started


def _report(name, model_dir, evals, wall):
    result = json.loads((model_dir / "result.json").read_text())
    last = mr.metrics(model_dir, "train")[-1]
    reached = next((seconds for seconds, _, value in evals if value >= 800), None)
    print(f"{name}: eval (s, step, return) {evals}; first >= 800 at {reached} s; {wall:.0f} s end to end "
          f"(training {result['wall_time_s']:.0f} s); {last['learner_steps_per_sec']:.1f} learner steps/s, "
          f"{last.get('transitions_per_sec', last['env_steps_per_sec']):.0f} env steps/s")
    return result


@pytest.mark.slow
def test_d4pg_control_learns_cartpole_balance(tmp_path):
    """As shipped: the final evaluation (10 episodes) averages >= 800 of 1000
    (`expframe.reproduce.registry.D4PG_CONTROL`, docs/results.md)."""
    learning = registry.get("d4pg_control")
    model_dir = tmp_path / "run"
    code, out, evals, wall = _timed_run(learning.gin_files, model_dir, tmp_path, learning.params())
    assert code == 0, out[-3000:]
    result = _report("d4pg cartpole/balance, acting in the learner's process", model_dir, evals, wall)
    assert learning.passed(result["eval"]), [t.text() for t in learning.thresholds]


@pytest.mark.slow
def test_d4pg_with_two_actor_processes_learns_cartpole_balance(tmp_path):
    """The same learner (1 replica, batch 256, 32 samples per insert) fed by 2 actor
    processes over RPC, the count that fits 2 cores: final evaluation >= 800 of 1000
    (`expframe.reproduce.registry.D4PG_ACTORS`, docs/results.md)."""
    learning = registry.get("d4pg_control_actors")
    model_dir = tmp_path / "run"
    code, out, evals, wall = _timed_run(learning.gin_files, model_dir, tmp_path, learning.params())
    assert code == 0, out[-3000:]
    result = _report("d4pg cartpole/balance, 2 actor processes", model_dir, evals, wall)
    last = mr.metrics(model_dir, "train")[-1]
    assert last["actors_alive"] == 2 and last["samples_per_insert"] <= 32.0, last
    assert learning.passed(result["eval"]), [t.text() for t in learning.thresholds]
