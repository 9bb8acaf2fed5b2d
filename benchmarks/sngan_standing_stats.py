"""Copied versus standing batch-norm statistics of an SN-GAN's moving average, measured.

    python main.py --gin_file=experiments/sngan_shapes.gin --model_dir=/tmp/shapes \\
        --gin_param="Trainer.max_checkpoints = 5"          # keep every 1,000-step checkpoint
    python benchmarks/sngan_standing_stats.py --model_dir=/tmp/shapes [--passes=0,4,16,64] [--steps=5000] \\
        [--eval_seeds=1234,1,2]

Builds the run's task from `<model_dir>/config.gin`, restores each checkpoint in the
model_dir, and evaluates its moving-average generator (`GANTask.ema_decay`) as the
run does (`GANTask.evaluate`: FID, Inception Score, sample class accuracy over
`GANTask.num_eval_samples` samples with the evaluation seed), once per entry of
`--passes`: 0 samples with the batch-norm statistics copied from the online
generator, K > 0 with standing statistics from K training-mode passes
(`GANTask.ema_standing_passes`). `--eval_seeds` repeats each evaluation with other
`GANTask.eval_seed`s (other sample noise and other standing passes; the real images
are the same), which shows how far FID and accuracy move by the draw of the samples
alone. Evaluation is deterministic, so the numbers do not depend on the machine's
load; the load average is recorded anyway. A table on stdout (and the mean and
standard deviation over the seeds per step and passes), JSON in
`benchmarks/results/sngan_standing_stats.json`.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="a finished GAN run with checkpoints")
    parser.add_argument("--passes", default="0,16", help="comma-separated GANTask.ema_standing_passes to compare")
    parser.add_argument("--steps", default=None, help="comma-separated checkpoint steps to evaluate (default: all)")
    parser.add_argument("--eval_seeds", default=None, help="comma-separated GANTask.eval_seed values "
                        "(default: the run's)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "sngan_standing_stats.json"))
    args = parser.parse_args()
    passes = [int(p) for p in args.passes.split(",")]
    steps = None if args.steps is None else {int(s) for s in args.steps.split(",")}
    eval_seeds = None if args.eval_seeds is None else [int(s) for s in args.eval_seeds.split(",")]
    with open("/proc/loadavg", encoding="utf-8") as f:
        load_start = f.read().split()[:3]

    import gin  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import expframe as xf  # pylint: disable=import-outside-toplevel
    from expframe import config  # pylint: disable=import-outside-toplevel
    from expframe.tasks.gan import GANTask  # pylint: disable=import-outside-toplevel

    os.chdir(ROOT)  # the run's config.gin includes files relative to the repository
    config.parse([os.path.join(args.model_dir, "config.gin")], [])
    rep = xf.Replicator()
    batch = gin.query_parameter("Trainer.global_batch_size")
    task = GANTask()
    if task.ema_decay is None:
        raise SystemExit("error: the run has no moving average (GANTask.ema_decay): nothing to compare.")
    task.setup(rep, batch, seed=gin.query_parameter("run_experiment.seed"), deterministic=False)
    with rep.scope():
        task.build()

    class Runner:
        global_batch_size, eval_steps = batch, None

    state = tf.train.get_checkpoint_state(os.path.join(args.model_dir, "checkpoints"))
    if state is None:
        raise SystemExit(f"error: no checkpoints in {args.model_dir}/checkpoints.")
    rows, started = [], time.time()
    checkpoint = tf.train.Checkpoint(**task.trackables())
    for path in state.all_model_checkpoint_paths:
        checkpoint.restore(path).expect_partial()
        step = int(task.generator_optimizer.iterations.numpy())
        if steps is not None and step not in steps:
            continue
        for seed in eval_seeds or [task.eval_seed]:
            task.eval_seed = seed
            for k in passes:
                task.ema_standing_passes = k
                metrics = task.evaluate(Runner())
                rows.append(dict(step=step, passes=k, eval_seed=seed,
                                 **{m: round(float(v), 4) for m, v in metrics.items()}))
                print(f"step {step:>6}  passes {k:>3}  eval_seed {seed:>5}  "
                      + "  ".join(f"{m} {v:.4f}" for m, v in metrics.items()), flush=True)
    if not rows:
        raise SystemExit(f"error: none of the checkpoints in {args.model_dir}/checkpoints is at --steps={args.steps}.")
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[:3]
    result = {"model_dir": args.model_dir, "num_replicas": rep.num_replicas, "num_eval_samples": task.num_eval_samples,
              "generator_batch": task.generator_batch_size, "rows": rows, "loadavg_start": load_start,
              "loadavg": load, "eval_wall_s": round(time.time() - started, 1)}
    print("\n| " + " | ".join(rows[0]) + " |\n" + "|---" * len(rows[0]) + "|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    names = [m for m in rows[0] if m not in ("step", "passes", "eval_seed")]
    result["over_seeds"] = []
    for step, k in sorted({(r["step"], r["passes"]) for r in rows}):
        group = [r for r in rows if (r["step"], r["passes"]) == (step, k)]
        stats = {m: (round(float(np.mean([r[m] for r in group])), 4),
                     round(float(np.std([r[m] for r in group], ddof=1)), 4) if len(group) > 1 else None)
                 for m in names}
        result["over_seeds"].append(dict(step=step, passes=k, seeds=len(group), **stats))
    if any(g["seeds"] > 1 for g in result["over_seeds"]):
        print("\nmean +- standard deviation over the eval seeds\n| step | passes | " + " | ".join(names) + " |\n"
              + "|---" * (2 + len(names)) + "|")
        for g in result["over_seeds"]:
            print(f"| {g['step']} | {g['passes']} | " + " | ".join(f"{g[m][0]:.4f} +- {g[m][1]:.4f}" for m in names)
                  + " |")
    from machine import write_result  # pylint: disable=import-outside-toplevel  (benchmarks/machine.py)
    write_result(args.out, result, indent=1, say=False)
    print(f"load average {' '.join(load_start)} at the start, {' '.join(load)} at the end; wrote {args.out}")


if __name__ == "__main__":
    main()
