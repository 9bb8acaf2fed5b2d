"""D4PG throughput: learner updates/s on 1 and 2 CPU replicas, environment steps/s
with 1 and 2 actor processes, and the time an actor waits for weights, in one run.

    python benchmarks/d4pg_throughput.py            # ~4 minutes on 2 cores
    python benchmarks/d4pg_throughput.py --quick    # ~2 minutes
    python benchmarks/d4pg_throughput.py --smoke    # that it runs: numbers meaningless

Learner: `main.py` on experiments/d4pg_control.gin (Acme's networks, batch 256),
acting in the learner's process, `Replicator.num_replicas` 1 and 2; the task's
`learner_steps_per_sec` counts the time of the host calls of train steps only (the
first, which traces, excluded), so acting does not enter it.
Actors: K processes of `python -m expframe.rl.actor_process` (the shipped policy,
cartpole/balance, `weights_every` 100) against a `LearnerService` in this process
with no insert limit and weights republished every 0.1 s (a busy learner); each
actor writes its acting time and its time in weight fetches at exit. Environment
steps/s is the sum over actors of steps / wall time of the window.
Results: a table on stdout and JSON in `benchmarks/results/d4pg_throughput[_quick].json`
(or `--out`).
"""

import argparse
import json
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


def learner_rate(replicas: int, steps: int, tmp: str, extra_params=()) -> float:
    """Learner updates/s of main.py on experiments/d4pg_control.gin (bindings in
    `extra_params` last, e.g. the target); the first host call (tracing) not counted."""
    params = [f"Replicator.num_replicas = {replicas}", f"Trainer.train_steps = {steps}", "Trainer.steps_per_loop = 10",
              f"Trainer.log_every_steps = {steps}", "Trainer.eval_every_steps = None",
              f"Trainer.checkpoint_every_steps = {steps}", "D4PGTask.min_replay_size = 1000", *extra_params]
    return learner_steps_per_sec("experiments/d4pg_control.gin", params, os.path.join(tmp, f"learner_{replicas}"))


def actor_rates(num_actors: int, seconds: float, tmp: str) -> dict:
    import gin  # pylint: disable=import-outside-toplevel

    from expframe import config  # pylint: disable=import-outside-toplevel
    from expframe.models.d4pg import d4pg_policy  # pylint: disable=import-outside-toplevel
    from expframe.rl.rpc import LearnerService  # pylint: disable=import-outside-toplevel

    gin.clear_config()
    config.parse([os.path.join(ROOT, "experiments/d4pg_control.gin")], [])
    gin_file = os.path.join(tmp, "config.gin")
    with open(gin_file, "w", encoding="utf-8") as f:
        f.write(gin.config_str())
    policy = d4pg_policy(observation_size=5, action_size=1)
    shapes = {"observation": (5,), "action": (1,), "reward": (), "discount": (), "next_observation": (5,)}
    service = LearnerService(policy.get_weights(), shapes, capacity=10**7)
    stats = [os.path.join(tmp, f"actors{num_actors}_{i}.json") for i in range(num_actors)]
    owner = processes.owner()  # each actor in a session of its own, stopped with this script
    procs = [owner.start([sys.executable, "-m", "expframe.rl.actor_process", f"--address={service.address}",
                               f"--actor_id={i}", f"--seed={i}", "--sigma=0.3", "--weights_every=100",
                               f"--gin_config={gin_file}", f"--stats_file={stats[i]}"],
                         f"actor {i}", cwd=ROOT, capture=False)
             for i in range(num_actors)]
    service.wait_for(num_actors * 100, timeout=300)   # all started (TensorFlow imported)
    first = service.inserted
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        time.sleep(0.1)
        service.publish(policy.get_weights())
        service.take()
    window = time.perf_counter() - started
    steps = service.inserted - first
    service.close()
    for p in procs:
        owner.reap(p, timeout=60)
    per_actor = []
    for path in stats:
        with open(path, encoding="utf-8") as f:
            per_actor.append(json.load(f))
    fetches = sum(s["fetches"] for s in per_actor)
    return {"env_steps_per_sec": steps / window,
            "weight_wait_ms_per_fetch": 1000 * sum(s["weight_wait_s"] for s in per_actor) / max(fetches, 1),
            "weight_wait_fraction": sum(s["weight_wait_s"] for s in per_actor)
            / max(sum(s["weight_wait_s"] + s["acting_s"] + s["insert_wait_s"] for s in per_actor), 1e-9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, a shorter acting window")
    parser.add_argument("--smoke", action="store_true", help="20 learner steps, a 1 s window: that it runs")
    parser.add_argument("--out", default=None, help="the JSON file (default benchmarks/results/...)")
    args = parser.parse_args()
    steps, seconds = (20, 1.0) if args.smoke else (200, 15.0) if args.quick else (600, 40.0)
    # Other jobs on the machine slow both sides of every ratio; the load says how busy it was.
    results = {"cpu": cpu_name(), "cores": os.cpu_count(), "quick": args.quick,
               "load_average_at_start": round(os.getloadavg()[0], 2), "learner": {}, "actors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in (1, 2):
            results["learner"][replicas] = learner_rate(replicas, steps, tmp)
        for k in (1, 2):
            results["actors"][k] = actor_rates(k, seconds, tmp)
    results["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(f"D4PG throughput on {results['cpu']} ({results['cores']} cores; load average "
          f"{results['load_average_at_start']} at start, {results['load_average_at_end']} at end)")
    print(f"{'what':<34}{'1':>12}{'2':>12}{'2 / 1':>8}")
    l1, l2 = results["learner"][1], results["learner"][2]
    print(f"{'learner updates/s (replicas)':<34}{l1:>12.1f}{l2:>12.1f}{l2 / l1:>8.2f}")
    a1, a2 = results["actors"][1], results["actors"][2]
    print(f"{'env steps/s (actor processes)':<34}{a1['env_steps_per_sec']:>12.0f}{a2['env_steps_per_sec']:>12.0f}"
          f"{a2['env_steps_per_sec'] / a1['env_steps_per_sec']:>8.2f}")
    print(f"{'weight fetch, ms (actor processes)':<34}{a1['weight_wait_ms_per_fetch']:>12.1f}"
          f"{a2['weight_wait_ms_per_fetch']:>12.1f}")
    print(f"{'time in weight fetches (fraction)':<34}{a1['weight_wait_fraction']:>12.3f}"
          f"{a2['weight_wait_fraction']:>12.3f}")
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"d4pg_throughput{'_quick' if args.quick or args.smoke else ''}.json")
    write_result(out, results)


if __name__ == "__main__":
    main()
