"""D4PG from pixels, throughput side by side in one run: rendered environment frames/s with
1, 2 and 4 actor processes, and learner updates/s of the pixel networks on 1 and 2 replicas.

    python benchmarks/d4pg_pixels_throughput.py            # ~9 minutes on 2 quiet cores
    python benchmarks/d4pg_pixels_throughput.py --quick    # ~4 minutes

Actors: K processes of `python -m expframe.rl.actor_process` on
experiments/d4pg_control_pixels.gin (cartpole/swingup, 64x64 frames, 3 stacked, action
repeat 8, the DrQ encoder and policy acting on every frame, `weights_every` 100), each with
its render worker, sending their steps to a `LearnerService` in this process that takes
them at once (no insert limit) and republishes weights every 0.1 s. Frames/s is the steps
received (one rendered frame per step) from the first take after every actor has sent
once to the last take of the window, which lasts at least 10 inserts of every actor.
Learner: `main.py` on the same gin file, acting in the learner's process, 1,000 frames in
replay before learning, `Replicator.num_replicas` 1 and 2 at the gin file's global batch;
the task's `learner_steps_per_sec` counts its host calls of train steps only (acting and
the first call, which traces, excluded).
Results: a table on stdout and JSON in `benchmarks/results/d4pg_pixels_throughput[_quick].json`.
"""

import argparse
import os
import sys
import tempfile
import time

from expframe import processes  # noqa: E402
from learner_rate import learner_steps_per_sec  # noqa: E402  (benchmarks/learner_rate.py)
from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIN = "experiments/d4pg_control_pixels.gin"


def learner_rate(replicas: int, steps: int, tmp: str) -> float:
    params = [f"Replicator.num_replicas = {replicas}", f"Trainer.train_steps = {steps}", "Trainer.steps_per_loop = 10",
              f"Trainer.log_every_steps = {steps}", "Trainer.eval_every_steps = None",
              f"Trainer.checkpoint_every_steps = {10 * steps}", "D4PGTask.min_replay_size = 1000",
              "D4PGTask.max_replay_size = 20_000", "D4PGTask.eval_episodes = 1"]
    return learner_steps_per_sec(GIN, params, os.path.join(tmp, f"learner_{replicas}"))


def actor_rate(num_actors: int, seconds: float, weights_every: int, tmp: str) -> dict:
    import gin  # pylint: disable=import-outside-toplevel

    from expframe import config  # pylint: disable=import-outside-toplevel
    from expframe.rl import experience  # pylint: disable=import-outside-toplevel
    from expframe.rl.environments import control_suite  # pylint: disable=import-outside-toplevel
    from expframe.rl.rpc import LearnerService  # pylint: disable=import-outside-toplevel
    from expframe.tasks.d4pg import D4PGTask  # pylint: disable=import-outside-toplevel

    gin.clear_config()
    config.parse([os.path.join(ROOT, GIN)], [])
    gin_file = os.path.join(tmp, "config.gin")
    with open(gin_file, "w", encoding="utf-8") as f:
        f.write(gin.config_str())
    environment = control_suite(seed=0)   # the gin file's task, for its shapes (its worker stops below)
    policy = D4PGTask().make_acting_policy(environment)
    service = LearnerService(policy.get_weights(), experience.rpc_fields(environment), capacity=10**6)
    environment.close()
    stats = [os.path.join(tmp, f"actors{num_actors}_{i}.json") for i in range(num_actors)]
    owner = processes.owner()  # each actor in a session of its own, stopped with this script
    procs = [owner.start([sys.executable, "-m", "expframe.rl.actor_process", f"--address={service.address}",
                               f"--actor_id={i}", f"--seed={i}", "--sigma=0.3", f"--weights_every={weights_every}",
                               f"--gin_config={gin_file}", f"--stats_file={stats[i]}"],
                         f"actor {i}", cwd=ROOT, capture=False)
             for i in range(num_actors)]
    deadline = time.time() + 900
    while len(service.versions_used) < num_actors and time.time() < deadline:   # every actor is running
        time.sleep(0.2)
        service.take_inserts()
    if len(service.versions_used) < num_actors:
        raise SystemExit(f"only {len(service.versions_used)} of {num_actors} actors sent steps within 900 s")
    counts = {i: 0 for i in range(num_actors)}
    started, last, frames = time.perf_counter(), None, 0
    while time.perf_counter() - started < seconds or min(counts.values()) < 10:
        time.sleep(0.1)
        service.publish(policy.get_weights())
        taken = service.take_inserts()
        for actor_id, steps in taken:
            counts[actor_id] += 1
            frames += len(steps["reward"])
        if taken:
            last = time.perf_counter()
    window = last - started
    service.close()
    for p in procs:
        owner.reap(p, timeout=120)
    gin.clear_config()
    return {"frames_per_sec": frames / window, "window_s": window, "frames": frames,
            "inserts_per_actor": counts, "weights_every": weights_every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer learner steps, shorter acting windows")
    args = parser.parse_args()
    steps, seconds, weights_every = (30, 20.0, 20) if args.quick else (150, 60.0, 100)
    results = {"cpu": cpu_name(), "cores": os.cpu_count(), "quick": args.quick,
               "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "actors": {}, "learner": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (1, 2, 4):
            results["actors"][k] = actor_rate(k, seconds, weights_every, tmp)
            print(f"{k} actor process(es): {results['actors'][k]['frames_per_sec']:.1f} frames/s", flush=True)
        for replicas in (1, 2):
            results["learner"][replicas] = learner_rate(replicas, steps, tmp)
            print(f"learner on {replicas} replica(s): {results['learner'][replicas]:.2f} updates/s", flush=True)
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"D4PG from pixels on {results['cpu']} ({results['cores']} cores; load average "
          f"{results['load_average_at_start']} at start, {results['load_average_at_end']} at end)")
    a = {k: results["actors"][k]["frames_per_sec"] for k in (1, 2, 4)}
    print(f"{'what':<40}{'1':>9}{'2':>9}{'4':>9}{'2 / 1':>8}{'4 / 1':>8}")
    print(f"{'env frames/s (actor processes)':<40}{a[1]:>9.1f}{a[2]:>9.1f}{a[4]:>9.1f}{a[2] / a[1]:>8.2f}"
          f"{a[4] / a[1]:>8.2f}")
    l1, l2 = results["learner"][1], results["learner"][2]
    print(f"{'learner updates/s (replicas), batch 64':<40}{l1:>9.2f}{l2:>9.2f}{'':>9}{l2 / l1:>8.2f}")
    out = os.path.join(ROOT, "benchmarks", "results", f"d4pg_pixels_throughput{'_quick' if args.quick else ''}.json")
    write_result(out, results)


if __name__ == "__main__":
    main()
