"""Pixel D4PG's weight lag: how many learner steps old the weights were that each inserted
transition was acted with, acting in the learner's process, with 1 and with 2 actor
processes (weights fetched every 100 environment steps, the default), and with 1 actor
fetching every 20 (one host call of learner steps), in one run.

    python benchmarks/d4pg_weight_lag.py            # ~10 minutes on 2 cores: 4 arms x 400 learner steps
    python benchmarks/d4pg_weight_lag.py --quick    # 16x16 frames, tiny networks, 40 learner steps

Each arm is `main.py` on experiments/d4pg_control_pixels.gin as shipped (64x64 frames,
batch 64, `weights_every` 100 environment steps, `steps_per_loop` 10) with
`D4PGTask.num_actors` 0, 1 or 2 (and `weights_every` 20 in the fourth arm), to `--steps`
learner steps; its last train record's `weight_lag_*` metrics count every transition inserted since the start by its lag
(`expframe.rl.actor_pool.lag_histogram`). Prints one row per arm: the share of
transitions at each lag, the mean and the largest lag; JSON in
benchmarks/results/d4pg_weight_lag[_quick].json (or --out).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIXELS = "experiments/d4pg_control_pixels.gin"
QUICK = ("control_suite.size = 16", "control_suite.frame_stack = 2", "drq_encoder.num_filters = 4",
         "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8", "d4pg_policy.layer_sizes = (16,)",
         "d4pg_critic.layer_sizes = (16,)", "D4PGTask.min_replay_size = 100", "D4PGTask.max_replay_size = 2000")
ARMS = (("in the learner's process", 0, ()), ("1 actor process", 1, ()), ("2 actor processes", 2, ()),
        ("1 actor, weights_every 20", 1, ("D4PGTask.weights_every = 20",)))


def run_arm(actors: int, steps: int, extra, tmp: str, timeout: float) -> dict:
    model_dir = tempfile.mkdtemp(prefix=f"actors_{actors}_", dir=tmp)
    params = list(extra) + [f"D4PGTask.num_actors = {actors}", f"Trainer.train_steps = {steps}",
                            f"Trainer.log_every_steps = {steps}", "Trainer.eval_every_steps = None",
                            f"Trainer.checkpoint_every_steps = {steps}", "D4PGTask.eval_episodes = 1"]
    command = [sys.executable, "main.py", f"--gin_file={PIXELS}", f"--model_dir={model_dir}", "--mode=train"]
    done = subprocess.run(command + [f"--gin_param={p}" for p in params], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if done.returncode:
        raise RuntimeError(f"{actors} actor(s): exit {done.returncode}: {done.stderr.strip()[-600:]}")
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = [r for r in map(json.loads, f) if r.get("split") == "train"][-1]
    histogram = {k[len("weight_lag_"):]: v for k, v in last.items()
                 if k.startswith("weight_lag_") and k != "weight_lag_mean"}
    total = sum(histogram.values())
    return {"actors": actors, "step": last["step"], "transitions": total, "histogram": histogram,
            "mean": last.get("weight_lag_mean", 0.0), "max": last.get("max_weights_version_lag", 0.0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per arm (400; --quick 40)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    steps = args.steps or (40 if args.quick else 400)
    extra = QUICK if args.quick else ()
    rows = []
    with tempfile.TemporaryDirectory(prefix="d4pg_weight_lag_") as tmp:
        for name, actors, bindings in ARMS:
            row = run_arm(actors, steps, tuple(extra) + bindings, tmp, args.timeout)
            row["arm"] = name
            rows.append(row)
            total = max(row["transitions"], 1)
            shares = "  ".join(f"{lag} {n / total:.1%}" for lag, n in row["histogram"].items() if n)
            print(f"{name:26s} {row['transitions']:7.0f} transitions  mean lag {row['mean']:.2f}  max "
                  f"{row['max']:.0f}  by lag (learner steps): {shares}", flush=True)
    result = {"benchmark": "d4pg_weight_lag", "cpu": cpu_name(), "cpu_count": os.cpu_count(), "steps": steps,
              "quick": args.quick, "gin_file": PIXELS, "bindings": list(extra), "arms": rows}
    name = "d4pg_weight_lag_quick.json" if args.quick else "d4pg_weight_lag.json"
    write_result(args.out or os.path.join(ROOT, "benchmarks", "results", name), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
