"""What DrQ's and CURL's compute settings cost pixel D4PG on this machine: learner updates/s
of experiments/d4pg_control_pixels_100k.gin at the CPU-scale file's settings (batch 64, 16
encoder filters, 64x64 frames: d4pg_control_pixels.gin's), with each published value in
turn (batch 512, 32 filters, 84x84 frames), with the 100k file's own (32 filters and 84x84
at batch 64), and with all three (DrQ's), in one run.

    python benchmarks/d4pg_pixels_compute.py            # ~12 minutes on 2 cores
    python benchmarks/d4pg_pixels_compute.py --quick    # 20 updates, 2 arms

Each arm is `main.py` on the 100k file with the arm's bindings, 600 agent steps of seed
data, and `--steps` updates; the task's `learner_steps_per_sec` times the host calls of
updates only (the first, which traces, excluded), so rendering and acting do not enter
it. Prints one row per arm: updates/s, its cost per update relative to the first arm,
and the hours 11,500 updates (the file's 100,000 control steps) would take
at that rate; JSON in benchmarks/results/d4pg_pixels_compute[_quick].json (or --out).
"""

import argparse
import os
import sys
import tempfile

from learner_rate import learner_steps_per_sec  # noqa: E402  (benchmarks/learner_rate.py)
from machine import ROOT, cpu_name, load_average, write_result  # noqa: E402  (benchmarks/machine.py)

GIN_FILE = "experiments/d4pg_control_pixels_100k.gin"
UPDATES = 11_500  # the file's updates: 100,000 control steps
BASE = ("drq_encoder.num_filters = 16", "control_suite.size = 64")  # d4pg_control_pixels.gin's
PUBLISHED = {"batch 512": ("Trainer.global_batch_size = 512", "D4PGTask.samples_per_insert = 512.0"),
             "32 filters": ("drq_encoder.num_filters = 32",),
             "84x84 frames": ("control_suite.size = 84",)}
ARMS = (("batch 64, 16 filters, 64x64", ()),) + tuple(
    (name, bindings) for name, bindings in PUBLISHED.items()) + (
    ("the 100k file: batch 64, 32 filters, 84x84", PUBLISHED["32 filters"] + PUBLISHED["84x84 frames"]),
    ("DrQ: batch 512, 32 filters, 84x84", sum(PUBLISHED.values(), ())))


def rate(bindings, steps: int, tmp: str) -> float:
    """Learner updates/s of the 100k file with `bindings`, first host call excluded."""
    params = ["D4PGTask.min_replay_size = 600", f"Trainer.train_steps = {steps}", "Trainer.steps_per_loop = 10",
              f"Trainer.log_every_steps = {steps}", "Trainer.eval_every_steps = None",
              f"Trainer.checkpoint_every_steps = {steps}", *BASE, *bindings]
    return learner_steps_per_sec(GIN_FILE, params, tempfile.mkdtemp(prefix="arm_", dir=tmp))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 updates per arm; the first and DrQ's arms only")
    parser.add_argument("--steps", type=int, default=None, help="updates per arm (default 40; --quick 20)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 40)
    arms = (ARMS[0], ARMS[-1]) if args.quick else ARMS
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("MUJOCO_GL", "egl")
    rows, load_start = [], load_average()
    with tempfile.TemporaryDirectory(prefix="d4pg_pixels_compute_") as tmp:
        for name, bindings in arms:
            updates_per_s = rate(bindings, steps, tmp)
            base = rows[0]["updates_per_s"] if rows else updates_per_s
            row = {"arm": name, "bindings": list(bindings), "updates_per_s": updates_per_s,
                   "cost_per_update_vs_first": base / updates_per_s,
                   "hours_for_100k_control_steps": UPDATES / updates_per_s / 3600}
            rows.append(row)
            print(f"{name:40s} {updates_per_s:7.3f} updates/s  x{row['cost_per_update_vs_first']:5.1f} per "
                  f"update  {row['hours_for_100k_control_steps']:6.2f} h for {UPDATES:,} updates", flush=True)
    result = {"benchmark": "d4pg_pixels_compute", "cpu": cpu_name(), "cpu_count": os.cpu_count(), "steps": steps,
              "gin_file": GIN_FILE, "load_average_start": load_start, "load_average_end": load_average(),
              "arms": rows}
    name = "d4pg_pixels_compute_quick.json" if args.quick else "d4pg_pixels_compute.json"
    write_result(args.out or os.path.join(ROOT, "benchmarks", "results", name), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
