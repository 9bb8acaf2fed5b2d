"""What lockstep acting costs: D4PG learner steps per second with actor processes running
free (the default) and in lockstep with the learner (`D4PGTask.lockstep = True`, what
`run_experiment.deterministic = True` turns on), side by side, interleaved, in one run.

    python benchmarks/d4pg_lockstep.py            # ~10 minutes on 2 cores: 4 arms x 2 repeats x 400 steps
    python benchmarks/d4pg_lockstep.py --quick    # tiny networks, 60 learner steps, 1 repeat

Each arm is `main.py` on experiments/d4pg_control.gin as shipped (batch 256, 8
environment steps per learner step, host calls of 10 learner steps, chunks of 100
environment steps) with 1 or 2 actor processes, to `--steps` learner steps, with op
determinism off in both (so the arms differ only in how acting is scheduled). Learner
steps per second count the training loop's time (acting waits included, start-up and the
first host call, which traces the step, left out): from the train records' examples/s.
Prints, per actor count, both rates and their ratio per repeat (lockstep / free) with the
minimum, median and maximum; JSON in benchmarks/results/d4pg_lockstep[_quick].json (or --out).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN = "experiments/d4pg_control.gin"
QUICK = ("d4pg_policy.layer_sizes = (16, 16)", "d4pg_critic.layer_sizes = (16, 16)", "Trainer.global_batch_size = 32",
         "D4PGTask.min_replay_size = 100", "D4PGTask.samples_per_insert = 8.0", "D4PGTask.weights_every = 20")


def run_arm(actors: int, lockstep: bool, steps: int, extra, tmp: str, timeout: float) -> dict:
    """One run; its learner steps per second over the train records after the first."""
    model_dir = tempfile.mkdtemp(prefix=f"actors_{actors}_{'lockstep' if lockstep else 'free'}_", dir=tmp)
    log_every = max(steps // 4, 10)
    params = list(extra) + [f"D4PGTask.num_actors = {actors}", f"D4PGTask.lockstep = {lockstep}",
                            f"Trainer.train_steps = {steps}", f"Trainer.log_every_steps = {log_every}",
                            "Trainer.eval_every_steps = None", f"Trainer.checkpoint_every_steps = {steps}",
                            "D4PGTask.eval_episodes = 1"]
    command = [sys.executable, "main.py", f"--gin_file={GIN}", f"--model_dir={model_dir}", "--mode=train"]
    done = subprocess.run(command + [f"--gin_param={p}" for p in params], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if done.returncode:
        raise RuntimeError(f"{actors} actor(s), lockstep {lockstep}: exit {done.returncode}: "
                           f"{done.stderr.strip()[-600:]}")
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if r.get("split") == "train"]
    with open(os.path.join(model_dir, "resolved.json"), encoding="utf-8") as f:
        batch = json.load(f).get("global_batch_size") or 256
    seconds, counted, previous = 0.0, 0, train[0]["step"]
    for record in train[1:]:   # the first interval holds the traced first call and the actors' start
        n = record["step"] - previous
        seconds += n * batch / record["examples_per_sec"]
        counted, previous = counted + n, record["step"]
    return {"actors": actors, "lockstep": lockstep, "steps_per_sec": counted / seconds,
            "mean_lag": train[-1].get("weight_lag_mean"), "learner_wait_s": train[-1].get("learner_wait_s")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per arm (400; --quick 60)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of each arm (2; --quick 1)")
    parser.add_argument("--actors", default="1,2", help="actor counts to measure, comma-separated")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 2)
    extra = QUICK if args.quick else ()
    rows = []
    with tempfile.TemporaryDirectory(prefix="d4pg_lockstep_") as tmp:
        for actors in [int(a) for a in args.actors.split(",")]:
            ratios = []
            for repeat in range(repeats):
                order = (False, True) if repeat % 2 == 0 else (True, False)   # interleaved, alternating
                pair = {lockstep: run_arm(actors, lockstep, steps, extra, tmp, args.timeout) for lockstep in order}
                ratio = pair[True]["steps_per_sec"] / pair[False]["steps_per_sec"]
                ratios.append(ratio)
                rows += [dict(pair[False], repeat=repeat), dict(pair[True], repeat=repeat, ratio=ratio)]
                print(f"{actors} actor(s), repeat {repeat}: free {pair[False]['steps_per_sec']:.1f} learner steps/s, "
                      f"lockstep {pair[True]['steps_per_sec']:.1f} (ratio {ratio:.3f}; mean lag "
                      f"{pair[False]['mean_lag']:.1f} against {pair[True]['mean_lag']:.1f} learner steps)", flush=True)
            print(f"{actors} actor(s): lockstep / free over {repeats} repeat(s): min {min(ratios):.3f}  median "
                  f"{statistics.median(ratios):.3f}  max {max(ratios):.3f}", flush=True)
    result = {"benchmark": "d4pg_lockstep", "cpu": cpu_name(), "cpu_count": os.cpu_count(), "steps": steps,
              "repeats": repeats, "quick": args.quick, "gin_file": GIN, "bindings": list(extra), "runs": rows}
    name = "d4pg_lockstep_quick.json" if args.quick else "d4pg_lockstep.json"
    write_result(args.out or os.path.join(ROOT, "benchmarks", "results", name), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
