"""The planner against this machine: predicted and measured step time, side by side.

    python benchmarks/plan_vs_measured.py            # ~20 min on 2 idle cores: 2 experiments x 7 runs
    python benchmarks/plan_vs_measured.py --quick    # 2 points per experiment, short runs (a smoke run)

For the quickstart (ResNet-8, experiments/quickstart.gin) and a CIFAR ResNet-20 (the
same file with `resnet.depth = 20`, `resnet.stem_stride = 1`), at the experiment's
global batch of 120:

* measured: the real trainer (`main.py --mode=train`) at 1, 2, 4 and 8 logical CPU
  replicas (target 'cpu'), and at 2 and 4 worker processes on 127.0.0.1
  (`python -m expframe.launch --workers=N`, target 'multi_worker'); the step time is
  global batch / examples/s of the train metrics after the first logged interval
  (which holds the tracing), median over the rest;
* predicted: `python -m expframe.plan`'s model on hardware 'cpu' (this machine: FLOP/s
  measured by the probes), its utilisation and host time per op calibrated on two
  measured 1-replica steps, at batch 120 and at 15 (`model.calibrated_host`), and for
  models with synchronised batch norm the cost of one synchronised layer measured at
  each configuration (`expframe.plan.collective_probe`, a chain of SyncBatchNorm
  layers against plain ones): every multi-replica point is a prediction. Workers are
  modelled as hosts of one device joined by loopback, sharing this machine's cores.

Reports the error per point, (predicted - measured) / measured, and the median absolute
error (goal <= 0.20) with its spread over the points (`spread`: minimum, median,
maximum and a 95 % bootstrap interval of the median over the points,
expframe/reproduce/spread.py): it meets the goal when the whole interval is at or
under 0.20. The machine must be otherwise idle for the numbers to mean
anything: the load average before and after is recorded. JSON: --out (default
benchmarks/results/plan_vs_measured.json).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(_ROOT, "benchmarks", "results", "plan_vs_measured.json")
GLOBAL_BATCH = 120  # quickstart.gin's: divisible by 1, 2, 4 and 8
SMALL_BATCH = 15    # its share on 8 replicas: the second 1-replica calibration step
EXPERIMENTS = {"quickstart": (), "resnet20": ("resnet.depth = 20", "resnet.stem_stride = 1")}
CONFIGS = (("cpu", 1), ("cpu", 2), ("cpu", 4), ("cpu", 8), ("workers", 2), ("workers", 4))
GOAL = 0.20
_SYNC_PROBED = {}   # (kind, n) -> seconds per synchronised layer, measured in this run


def _bindings(steps: int, extra, batch: int = GLOBAL_BATCH) -> list:
    return list(extra) + [f"Trainer.global_batch_size = {batch}", f"Trainer.train_steps = {steps}",
                          "Trainer.steps_per_loop = 10", "Trainer.log_every_steps = 10",
                          "Trainer.eval_every_steps = None", f"Trainer.checkpoint_every_steps = {steps}"]


def measure(kind: str, n: int, bindings: list, timeout: float, batch: int = GLOBAL_BATCH) -> float:
    """Seconds per step of the real trainer at global batch `batch` (median over the logged
    intervals after the first; `bindings` set that batch)."""
    model_dir = tempfile.mkdtemp(prefix="plan_vs_measured_")
    try:
        params = [f"--gin_param={b}" for b in bindings]
        run = [sys.executable, "main.py", "--gin_file=experiments/quickstart.gin", f"--model_dir={model_dir}",
               "--mode=train"]
        if kind == "cpu":
            command = run + params + [f"--gin_param=Replicator.num_replicas = {n}"]
        else:
            command = [sys.executable, "-m", "expframe.launch", f"--workers={n}", "--"] + run[1:] + params + [
                "--gin_param=Replicator.target = 'multi_worker'", "--gin_param=Replicator.num_replicas = None"]
        done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{kind} x {n} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
        with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
            rates = [r["examples_per_sec"] for r in map(json.loads, f) if r.get("split") == "train"]
        if len(rates) < 2:
            raise RuntimeError(f"{kind} x {n}: {len(rates)} logged intervals; raise the step count")
        return batch / statistics.median(rates[1:])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def predict(extra, measured_one: float, measured_small: float, configs) -> dict:
    """Predicted step seconds per configuration, from two 1-replica steps (at the global
    batch and at SMALL_BATCH: utilisation and host time per op, `model.calibrated_host`)
    and, for a model with synchronised batch norm, the measured cost of one synchronised
    layer at each configuration (`collective_probe`)."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    from expframe.plan import collective_probe, model, planner  # pylint: disable=import-outside-toplevel
    from expframe.plan import measure as plan_measure  # pylint: disable=import-outside-toplevel
    files, params = ["experiments/quickstart.gin"], _bindings(100, extra)
    settings = plan_measure.experiment_settings(files, params)
    fp, _ = plan_measure.footprint(files, params, settings)
    hw = planner.hardware("cpu")
    st = model.Settings(utilisation=1.0, precision="float32", steps_per_loop=10)
    utilisation, per_op_s = model.calibrated_host(fp, hw, GLOBAL_BATCH, SMALL_BATCH, st, measured_one, measured_small)
    st, hw = dataclasses.replace(st, utilisation=utilisation), dataclasses.replace(hw, per_op_s=per_op_s)
    out = {"utilisation": utilisation, "cpu_flops": hw.peak_flops["fp32"], "per_op_s": per_op_s, "ops": fp.ops,
           "sync_layers": fp.sync_collectives, "sync_layer_s": {}}
    for kind, n in configs:
        sync = {}
        if fp.sync_collectives and n > 1:
            if (kind, n) not in _SYNC_PROBED:   # the same layer for every experiment: measured once
                _SYNC_PROBED[kind, n] = collective_probe.measure(kind, n)
            sync = {n: _SYNC_PROBED[kind, n]}
            out["sync_layer_s"][f"{kind} {n}"] = sync[n]
        target = dataclasses.replace(hw, sync_layer_s=sync)
        if kind != "cpu":
            target = dataclasses.replace(target, devices_per_host=1)
        out[f"{kind} {n}"] = model.plan_row(fp, target, n, GLOBAL_BATCH, st)["step_s"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 2 replicas only, 30 steps")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    configs = CONFIGS[:2] if args.quick else CONFIGS
    steps = 30 if args.quick else 100
    load_before = os.getloadavg()[0]
    experiments = []
    for name, extra in EXPERIMENTS.items():
        measured = {f"{kind} {n}": measure(kind, n, _bindings(steps, extra), args.timeout) for kind, n in configs}
        small = measure("cpu", 1, _bindings(steps, extra, SMALL_BATCH), args.timeout, SMALL_BATCH)
        predicted = predict(extra, measured["cpu 1"], small, configs)
        points = [{"config": key, "measured_s": measured[key], "predicted_s": predicted[key],
                   "error": (predicted[key] - measured[key]) / measured[key]} for key in measured if key != "cpu 1"]
        experiments.append({"name": name, "bindings": list(extra), "utilisation": predicted["utilisation"],
                            "cpu_flops": predicted["cpu_flops"], "per_op_s": predicted["per_op_s"],
                            "calibration_s": measured["cpu 1"], "calibration_small_batch_s": small,
                            "ops": predicted["ops"], "sync_layers": predicted["sync_layers"],
                            "sync_layer_s": predicted["sync_layer_s"], "points": points})
        for p in points:
            print(f"{name:10s} {p['config']:10s} predicted {p['predicted_s'] * 1e3:8.1f} ms  measured "
                  f"{p['measured_s'] * 1e3:8.1f} ms  error {p['error']:+.0%}", flush=True)
    errors = [abs(p["error"]) for e in experiments for p in e["points"]]
    from expframe.reproduce import spread  # pylint: disable=import-outside-toplevel
    result = {"global_batch_size": GLOBAL_BATCH, "steps": steps, "experiments": experiments, "goal": GOAL,
              "median_abs_error": statistics.median(errors),
              "spread": {"median_abs_error": spread.of(errors, over="points")}, "load_before": load_before,
              "load_after": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    print(f"median absolute error {result['median_abs_error']:.0%} (goal <= {GOAL:.0%}); load "
          f"{load_before:.2f} -> {result['load_after']:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
