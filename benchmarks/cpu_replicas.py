"""Logical CPU replicas: the quickstart at 8 replicas against 1, expframe against a plain loop.

    python benchmarks/cpu_replicas.py            # ~8 minutes on 2 idle cores
    python benchmarks/cpu_replicas.py --quick    # ~3 minutes: two variants, fewer calls

The quickstart's model (ResNet-8, SyncBatchNorm, stem stride 2, 32x32, 10 classes,
Adam 2e-3) at its global batch (120) trains on one synthetic in-memory batch two ways,
each on 1 and on 8 logical CPU devices of the same process:

  expframe  `ClassificationTask` + `Replicator('cpu', n)` + `Trainer`, timing one
            `trainer.run_train_steps(k)` host call (what `main.py` runs).
  plain     the tf.distribute guide's loop (benchmarks/handwritten.py) on
            `tf.distribute.MirroredStrategy(devices)` as a user writes it (on CPU
            devices TensorFlow 2.21 picks CollectiveAllReduce, RING), the same model
            and optimizer.

All four are timed interleaved; each reports examples/s (median over calls) and the
ratio 8 replicas / 1 replica. Threads are set before TensorFlow starts, so every
variant runs in its own process (this script with --role=worker):

  expframe   the cpu target's own setting: inter-op threads = max(cores, 2 x logical
             devices) (16 for 8 devices), intra-op = TensorFlow's default (the cores).
  tf_default TensorFlow's defaults (inter-op = intra-op = the cores).
  inter9     inter-op = devices + 1 (9): one per replica plus one for the reduction.
  intra1     expframe's inter-op, intra-op = 1: replicas run side by side, each op on
             one thread.
The reduction: expframe's cpu target reduces through one device
(`ReductionToOneDevice`); `--reduction` also tries the plain loop's strategy for
expframe (`--reduction=both`).

All logical CPU devices of a process share one intra-op pool (the cores) and one
inter-op pool; 8 logical replicas on 2 cores are 8 streams of small ops competing
for 2 cores, so neither loop can reach 1.0. The question is only whether expframe
loses more than the plain loop, and which setting closes it.

Needs a quiet machine: the 1-minute load average is recorded before and after.
Results: a table on stdout and JSON in benchmarks/results/cpu_replicas.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
RESULTS = os.path.join(_HERE, "results", "cpu_replicas.json")
GLOBAL_BATCH = 120
DEVICES = 8
VARIANTS = {  # name -> (inter-op threads, intra-op threads); None: leave it to expframe / TensorFlow
    "expframe": (None, None),
    "tf_default": (0, 0),
    "inter9": (DEVICES + 1, None),
    "intra1": (None, 1),
}


# -- worker --------------------------------------------------------------------------------

def worker(args) -> None:
    """One process, one thread setting: times expframe and the plain loop on 1 and 8 replicas."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, _HERE)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import expframe  # pylint: disable=import-outside-toplevel

    inter, intra = VARIANTS[args.variant]
    if intra:  # 0: TensorFlow's default (the cores)
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter is not None:  # set before the split: expframe's cpu target keeps a value that is set
        tf.config.threading.set_inter_op_parallelism_threads(inter if inter else os.cpu_count())
    expframe.split_cpu(DEVICES)
    threads = {"inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
               "intra_op": tf.config.threading.get_intra_op_parallelism_threads()}

    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    import handwritten  # pylint: disable=import-outside-toplevel
    from expframe.layers import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    from expframe.models.resnet import resnet  # pylint: disable=import-outside-toplevel
    from expframe.replicator import targets  # pylint: disable=import-outside-toplevel
    from expframe.tasks.classification import ClassificationTask  # pylint: disable=import-outside-toplevel
    from expframe.trainer import Trainer  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    batch = {"image": rng.standard_normal((GLOBAL_BATCH, 32, 32, 3)).astype(np.float32),
             "label": rng.integers(0, 10, GLOBAL_BATCH).astype(np.int32)}

    def model():
        keras.utils.set_random_seed(0)
        return resnet(depth=8, num_classes=10, input_shape=(32, 32, 3), norm=SyncBatchNorm, stem_stride=2)

    def dataset(per_replica):
        return tf.data.Dataset.from_tensors({k: v[:per_replica] for k, v in batch.items()}).repeat()

    def expframe_runner(n):
        task = ClassificationTask(model=model, dataset=lambda split, ctx, batch_size, **_: dataset(batch_size),
                                  optimizer=lambda: keras.optimizers.Adam(2e-3), eval_split=None)
        trainer = Trainer(train_steps=10 ** 9, global_batch_size=GLOBAL_BATCH)
        replicator = expframe.Replicator("cpu", n)
        if args.expframe_strategy == "tf_default":
            replicator.strategy = tf.distribute.MirroredStrategy(devices=targets.cpu_devices(n))
        trainer.prepare(replicator, task, seed=0, deterministic=False)
        return lambda k: trainer.run_train_steps(k)["loss"]

    def plain_runner(n):
        strategy = tf.distribute.MirroredStrategy(devices=targets.cpu_devices(n))
        with strategy.scope():
            net, opt = model(), keras.optimizers.Adam(2e-3)
        return handwritten.handwritten_loop(strategy, net, opt, dataset, GLOBAL_BATCH, 10)

    runners = {}
    for n in (1, DEVICES):
        runners[f"expframe_{n}"] = expframe_runner(n)
        runners[f"plain_{n}"] = plain_runner(n)
    plain = tf.distribute.MirroredStrategy(devices=targets.cpu_devices(DEVICES))
    plain_ops = type(plain.extended._cross_device_ops).__name__  # pylint: disable=protected-access
    names = list(runners)
    for name in names:  # trace, then once more untimed
        runners[name](args.steps_per_call)
        runners[name](args.steps_per_call)
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for i in range(args.calls):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = runners[name](args.steps_per_call)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            if not np.isfinite(loss):
                raise RuntimeError(f"{name}: loss {loss}")
    examples = args.steps_per_call * GLOBAL_BATCH
    rate = {name: examples / statistics.median(t) for name, t in times.items()}
    # CPU time (all threads of the process) per example: what the work costs, much less
    # sensitive than wall time to other processes on the machine (they add waiting, not CPU).
    cpu_us = {name: 1e6 * statistics.median(t) / examples for name, t in cpu.items()}
    record = {"variant": args.variant, "expframe_strategy": args.expframe_strategy, "threads": threads,
              "plain_cross_device_ops": plain_ops, "examples_per_sec": rate, "times_s": times,
              "cpu_us_per_example": cpu_us,
              "ratio_8_over_1": {"expframe": rate[f"expframe_{DEVICES}"] / rate["expframe_1"],
                                 "plain": rate[f"plain_{DEVICES}"] / rate["plain_1"]},
              "cpu_ratio_8_over_1": {"expframe": cpu_us[f"expframe_{DEVICES}"] / cpu_us["expframe_1"],
                                     "plain": cpu_us[f"plain_{DEVICES}"] / cpu_us["plain_1"]}}
    print("RESULT " + json.dumps(record), flush=True)


# -- driver --------------------------------------------------------------------------------

def run_variant(args, variant: str, expframe_strategy: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--role=worker", f"--variant={variant}",
           f"--expframe_strategy={expframe_strategy}", f"--steps_per_call={args.steps_per_call}",
           f"--calls={args.calls}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    for name in ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS", "EXPFRAME_CPU_DEVICES"):
        env.pop(name, None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"variant {variant} failed (status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two variants, fewer calls")
    parser.add_argument("--role", choices=("driver", "worker"), default="driver")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="expframe")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None)
    parser.add_argument("--reduction", choices=("expframe", "both"), default="expframe",
                        help="'both': also run expframe on the plain loop's strategy")
    parser.add_argument("--expframe_strategy", choices=("expframe", "tf_default"), default="expframe",
                        help=argparse.SUPPRESS)
    parser.add_argument("--steps_per_call", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    args.steps_per_call = args.steps_per_call or (4 if args.quick else 8)
    args.calls = args.calls or (5 if args.quick else 7)
    if args.role == "worker":
        worker(args)
        return 0
    variants = args.variants or (["expframe", "tf_default"] if args.quick else list(VARIANTS))
    runs = [(v, "expframe") for v in variants]
    if args.reduction == "both":
        runs.append(("expframe", "tf_default"))
    load_before, started = os.getloadavg()[0], time.time()
    print(f"quickstart model, global batch {GLOBAL_BATCH}, {args.steps_per_call} steps per call, {args.calls} "
          f"interleaved calls; {os.cpu_count()} CPUs, load average {load_before:.2f}", flush=True)
    print(f"{'variant':>11} {'reduction':>20} {'inter':>5} {'intra':>5} | {'xf 1':>7} {'xf 8':>7} {'plain 1':>7} "
          f"{'plain 8':>7} | {'xf 8/1':>6} {'plain 8/1':>9} | CPU us/example 8/1: {'xf':>5} {'plain':>5}",
          flush=True)
    records = []
    for variant, strategy in runs:
        r = run_variant(args, variant, strategy)
        records.append(r)
        rate, ratio = r["examples_per_sec"], r["ratio_8_over_1"]
        reduction = "ReductionToOneDevice" if strategy == "expframe" else r["plain_cross_device_ops"]
        print(f"{variant:>11} {reduction:>20} {r['threads']['inter_op']:>5} {r['threads']['intra_op']:>5} | "
              f"{rate['expframe_1']:>7.0f} {rate['expframe_8']:>7.0f} {rate['plain_1']:>7.0f} "
              f"{rate['plain_8']:>7.0f} | {ratio['expframe']:>6.3f} {ratio['plain']:>9.3f} | "
              f"{'':>19} {r['cpu_ratio_8_over_1']['expframe']:>5.2f} {r['cpu_ratio_8_over_1']['plain']:>5.2f}",
              flush=True)
    load_after = os.getloadavg()[0]
    print(f"examples/s (median); 1-minute load average {load_before:.2f} before, {load_after:.2f} after; "
          f"{time.time() - started:.0f} s")
    result = {"benchmark": "cpu_replicas", "model": "quickstart (ResNet-8, SyncBatchNorm)",
              "global_batch": GLOBAL_BATCH, "devices": DEVICES, "steps_per_call": args.steps_per_call,
              "calls": args.calls, "records": records,
              "load_average_1min": {"before": load_before, "after": load_after},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "wall_s": round(time.time() - started, 1)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
