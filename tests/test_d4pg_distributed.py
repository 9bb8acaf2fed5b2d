"""D4PG with actor processes (`D4PGTask.num_actors`) through main.py: 2 actors exchange
weights and transitions with the learner over RPC; a SIGKILLed actor is logged by id
and the run goes on without hanging."""

import json
import os
import signal
import time

import gin

from expframe import config
from tests import main_runner as mr

D4PG = "experiments/d4pg_control.gin"
# Small networks, cartpole with 8 control steps per environment step (125-step episodes).
SMALL = ("Replicator.num_replicas = 1", "Trainer.global_batch_size = 64", "Trainer.steps_per_loop = 20",
         "Trainer.checkpoint_every_steps = 1000", "d4pg_policy.layer_sizes = (64, 64)",
         "d4pg_critic.layer_sizes = (64, 64)", "control_suite.action_repeat = 8", "D4PGTask.min_replay_size = 500",
         "D4PGTask.samples_per_insert = 32.0", "D4PGTask.eval_episodes = 5", "D4PGTask.num_actors = 2",
         "D4PGTask.weights_every = 50", "actor/keras.optimizers.Adam.learning_rate = 1e-3",
         "critic/keras.optimizers.Adam.learning_rate = 1e-3")




def test_two_actor_processes_feed_the_learner_over_rpc(tmp_path):
    model_dir = tmp_path / "run"
    done = mr.run([D4PG], model_dir, tmp_path, SMALL + ("Trainer.train_steps = 100", "Trainer.log_every_steps = 20",
                                                        "Trainer.eval_every_steps = 100"), timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    train = mr.metrics(model_dir, "train")
    assert [r["step"] for r in train] == [20, 40, 60, 80, 100]
    last = train[-1]
    # Transitions came from the actors at the configured ratio: 500 before learning, then
    # 64 / 32 = 2 per learner step; actors run at most one host call plus a chunk ahead.
    assert 500 + 2 * 100 <= last["env_steps"] <= 500 + 2 * 120 + 2 * (50 + 5), last
    # The logged ratio is the measured one; actors may only run ahead, so it is <= 32.
    assert abs(last["samples_per_insert"] - 100 * 64 / (last["env_steps"] - 500)) < 1e-6, last
    assert 6400 / (2 * 120 + 2 * (50 + 5)) <= last["samples_per_insert"] <= 32.0, last   # the env_steps bounds above
    assert last["actors_alive"] == 2 and last["actor_restarts"] == 0
    assert last["replay_size"] == last["env_steps"]
    result = json.loads((model_dir / "result.json").read_text())
    assert 0.0 <= result["eval"]["episode_return"] <= 1000.0   # 125 steps x 8 control steps, reward <= 1
    assert "killed" not in done.stderr


def test_killed_actor_is_logged_and_the_run_goes_on(tmp_path):
    model_dir = tmp_path / "run"
    proc = mr.start([D4PG], model_dir, tmp_path, SMALL + (
        "Trainer.train_steps = 120", "Trainer.log_every_steps = 20", "Trainer.eval_every_steps = 120",
        "D4PGTask.max_actor_restarts = 0"))
    try:
        mr.wait_for_line(proc, "step 20/120", timeout=180)
        actors = _actor_pids(proc.pid)
        assert len(actors) == 2, actors
        os.kill(actors[0], signal.SIGKILL)
        killed_at = time.time()
        out, _ = proc.communicate(timeout=120)
        took = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert took < 30, took   # finishes the remaining 100 steps with the other actor
    lines = [line for line in out.splitlines() if "killed by SIGKILL" in line]
    assert len(lines) == 1 and lines[0].startswith("D4PGTask: actor "), out[-3000:]
    assert "going on with 1 actor(s)" in lines[0]
    assert mr.metrics(model_dir, "train")[-1]["actors_alive"] == 1


def _actor_pids(parent):
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and b"expframe.rl.actor_process" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


DISTRIBUTED = "experiments/d4pg_control_distributed.gin"


def test_distributed_experiment_smoke_run_on_two_replicas(tmp_path, monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    config.parse([DISTRIBUTED], [])
    try:
        assert gin.query_parameter("D4PGTask.num_actors") == 8
        assert len(gin.query_parameter("D4PGTask.actor_sigmas")) == 8
        assert gin.query_parameter("Replicator.num_replicas") == 2
        assert gin.query_parameter("D4PGTask.actor_service_address").startswith("127.0.0.1:")
    finally:
        gin.clear_config()
    # Shrunk: 2 actors (with their own sigmas), tiny networks, a few learner steps on 2 replicas.
    model_dir = tmp_path / "run"
    done = mr.run([DISTRIBUTED], model_dir, tmp_path, (
        "D4PGTask.num_actors = 2", "D4PGTask.actor_sigmas = (0.1, 0.5)", "D4PGTask.weights_every = 20",
        "Trainer.global_batch_size = 16", "Trainer.train_steps = 6", "Trainer.steps_per_loop = 3",
        "Trainer.log_every_steps = 3", "Trainer.eval_every_steps = None", "Trainer.checkpoint_every_steps = 3",
        "d4pg_policy.layer_sizes = (16, 16)", "d4pg_critic.layer_sizes = (16, 16)", "control_suite.action_repeat = 8",
        "D4PGTask.min_replay_size = 50", "D4PGTask.samples_per_insert = 4.0", "D4PGTask.eval_episodes = 1"),
        timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((model_dir / "result.json").read_text())
    assert (result["step"], result["num_replicas"]) == (6, 2)
    last = mr.metrics(model_dir, "train")[-1]
    assert last["actors_alive"] == 2 and 50 + 4 * 6 <= last["env_steps"] <= 50 + 4 * 9 + 2 * (20 + 5), last
