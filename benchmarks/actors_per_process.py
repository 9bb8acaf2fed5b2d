"""Actors per process: 8 pixel actors started by `ActorPool` as 8 processes of one actor,
2 of 4 and 1 of 8 (`D4PGTask.actors_per_process`), side by side in one run.

    python benchmarks/actors_per_process.py           # d4pg_control_pixels.gin's 64x64 frames, 60 s of acting per arm
    python benchmarks/actors_per_process.py --quick   # 16x16 frames, a tiny encoder, 15 s per arm

Each arm starts the 8 actors against a learner service that takes every transition at
once (no learner: acting alone is measured) and reports: seconds until every actor has
called the service (start-up), CPU-seconds the actor processes and their render workers
used until then, resident memory of the actor processes (TensorFlow's) and of the
render workers, and environment steps per second over `--seconds` once all are acting
(each actor fetching weights and sending every 20 environment steps).
Ratios are against 1 actor per process, measured in the same run. JSON in
benchmarks/results/actors_per_process[_quick].json (or --out).
"""

import argparse
import os
import sys
import time

from machine import ROOT, cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

PIXELS = "experiments/d4pg_control_pixels.gin"
QUICK = ("control_suite.size = 16", "control_suite.frame_stack = 2", "drq_encoder.num_filters = 4",
         "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8", "d4pg_policy.layer_sizes = (16,)")
ACTORS = 8
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK   # utime + stime
    except (OSError, IndexError):
        return 0.0


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return 0.0


def run_arm(per_process: int, weights, shapes, seconds: float) -> dict:
    from expframe import processes  # pylint: disable=import-outside-toplevel
    from expframe.rl.actor_pool import ActorPool  # pylint: disable=import-outside-toplevel
    started = time.monotonic()
    pool = ActorPool(weights, shapes, ACTORS, [0.3] * ACTORS, seed=0, weights_every=20, capacity=10**7,
                     max_restarts=0, acting="expframe.tasks.d4pg:acting_parts", actors_per_process=per_process)
    try:
        while len(pool.startup_s) < ACTORS:
            pool.check()
            pool.service.take()
            if time.monotonic() - started > 900:
                raise RuntimeError(f"{per_process} per process: {len(pool.startup_s)} of {ACTORS} ready in 900 s")
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        actor_pids = [p.pid for p in pool.processes.values()]
        workers = [w for pid in actor_pids for w in processes.descendants(pid)]
        startup_cpu = sum(_cpu_s(pid) for pid in actor_pids + workers)
        actor_mb, worker_mb = sum(map(_rss_mb, actor_pids)), sum(map(_rss_mb, workers))
        pool.service.take()
        begin, steps = time.monotonic(), 0
        while time.monotonic() - begin < seconds:
            pool.check()
            steps += len(pool.service.take().get("reward", ()))
            time.sleep(0.05)
        rate = steps / (time.monotonic() - begin)
    finally:
        pool.close()
    return {"actors_per_process": per_process, "processes": len(actor_pids), "render_workers": len(workers),
            "ready_s": round(ready_s, 1), "startup_cpu_s": round(startup_cpu, 1),
            "actor_processes_rss_mb": round(actor_mb), "render_workers_rss_mb": round(worker_mb),
            "env_steps_per_sec": round(rate, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=None, help="acting measured per arm (60; --quick 15)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    seconds = args.seconds or (15.0 if args.quick else 60.0)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.chdir(ROOT)
    from expframe import config  # pylint: disable=import-outside-toplevel
    from expframe.rl import experience  # pylint: disable=import-outside-toplevel
    from expframe.tasks.d4pg import acting_parts  # pylint: disable=import-outside-toplevel
    bindings = QUICK if args.quick else ()
    config.parse([PIXELS], list(bindings))
    parts = acting_parts(0)
    weights, shapes = parts.policy.get_weights(), experience.rpc_fields(parts.environment)
    parts.environment.close()
    rows = []
    for per_process in (1, 4, 8):
        row = run_arm(per_process, weights, shapes, seconds)
        rows.append(row)
        base = rows[0]
        ratio = lambda key, row=row, base=base: f"x{row[key] / base[key]:.2f}" if base[key] else "x-"  # noqa: E731
        print(f"{per_process} per process ({row['processes']} processes): all ready after {row['ready_s']:6.1f} s "
              f"({ratio('ready_s')}), start-up {row['startup_cpu_s']:6.1f} CPU-s ({ratio('startup_cpu_s')}), "
              f"actor processes {row['actor_processes_rss_mb']:5d} MB ({ratio('actor_processes_rss_mb')}), render "
              f"workers {row['render_workers_rss_mb']} MB, {row['env_steps_per_sec']:6.1f} env steps/s "
              f"({ratio('env_steps_per_sec')})", flush=True)
    result = {"benchmark": "actors_per_process", "cpu": cpu_name(), "cpu_count": os.cpu_count(), "actors": ACTORS,
              "quick": args.quick, "gin_file": PIXELS, "bindings": list(bindings), "seconds": seconds,
              "load_average_at_end": os.getloadavg()[0], "arms": rows}
    name = "actors_per_process_quick.json" if args.quick else "actors_per_process.json"
    write_result(args.out or os.path.join(ROOT, "benchmarks", "results", name), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
