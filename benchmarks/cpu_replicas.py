"""Logical CPU replicas: the quickstart at 8 replicas against 1, expframe against a plain loop.

    python benchmarks/cpu_replicas.py            # ~10 minutes on 2 idle cores
    python benchmarks/cpu_replicas.py --quick    # ~3 minutes: expframe and the plain loop, 1 repeat

The quickstart's model (ResNet-8, SyncBatchNorm, stem stride 2, 32x32, 10 classes,
Adam 2e-3) at its global batch (120) trains on one synthetic in-memory batch:

  expframe  `ClassificationTask` + `Replicator('cpu', n)` + `Trainer`, timing
            `trainer.run_train_steps(k)` host calls (what `main.py` runs), with the
            threads the cpu target sets (or a variant preset before it).
  plain     the tf.distribute guide's loop (benchmarks/handwritten.py) on
            `tf.distribute.MirroredStrategy(devices)` over logical CPU devices made with
            `tf.config.set_logical_device_configuration`, as a user writes it: no
            expframe code but the model (on CPU devices TensorFlow 2.21 then reduces
            with CollectiveAllReduce, RING).

Each configuration (runner, replicas, thread setting) runs in a process of its own, as
a user's run does (threads are fixed when TensorFlow starts, and expframe sets them
when it splits the CPU), one after another, `--repeats` times interleaved. It reports
examples/s (median over calls) and the CPU time per example (all threads of the
process: what the work costs, much less sensitive than wall time to other work on the
machine), and for each runner and setting the ratio 8 replicas / 1 replica.

Notes from the measurements: below, and docs/hardware.md ("Logical CPU replicas: threads").

Thread settings:
  expframe    what expframe's cpu target sets when it splits the CPU (into 8 devices, also
              for 1 replica): inter-op threads = max(cores, 2 x replicas) (16 at 8
              replicas; max(cores, 2 x devices) = 16 for every run before issue 61), the
              intra-op pool at TensorFlow's default (the cores).
  intra1      expframe's inter-op threads, intra-op pool 1 where the replicas are at least
              as many as the cores: every op runs on the inter-op thread that picked it
              up, and the replicas fill the cores side by side (a candidate default).
  tf_default  TensorFlow's defaults: inter-op = intra-op = the cores (the plain loop's;
              for expframe: preset before the Replicator, which then keeps them).
  expframe_threads  (plain loop) the plain loop with expframe's thread setting.

The default configurations make a grid that separates the threads from the framework:
expframe and the plain loop each with its own threads and with the other's
(`expframe:expframe`, `plain:tf_default`, `expframe:tf_default`,
`plain:expframe_threads`), then the candidate `expframe:intra1`.

Why 8 logical replicas cannot reach 1: they share the process's one intra-op pool and
one inter-op pool, on the same cores; a step of 8 x 15 examples is 8 streams of ops on
small tensors plus the collectives that join them (SyncBatchNorm's moments, the
gradient all-reduce) where 1 replica runs one stream on 120. The CPU time per example
measures that overhead; the wall time adds how well the streams fill the cores.
The ops columns count it: one host call of 5 steps is ~1,570 ops at 1 replica and
~23,900 at 8 (~2,840 on the busiest device), and TensorFlow's executor costs about the
same per op whatever its size, so 8 replicas of 15 examples pay ~15x the per-op cost
of 1 replica of 120 for the same work: most of the gap, which no thread setting
measured here closes.

Measured (2 cores, AMD EPYC, `--quick --configs expframe:expframe expframe:intra1
plain:tf_default`, load average 0.5 at start, 7.6 at the end: other work shared the
cores, so read the ratios, not the rates): 8/1 = 0.66 for expframe, 0.46 for the plain
loop on TensorFlow's default threads (0.56 and 0.60 when issue 23 was filed, by an
earlier version of this benchmark), 0.64 for intra1. intra1 spent 11% less CPU time
per example at 8 replicas (1,164 against 1,315 us) but was not faster by the clock (743 against 806
examples/s), so the cpu target keeps TensorFlow's intra-op pool; intra1 stays here as
the candidate to measure again on a quiet machine.

Needs a quiet machine: the 1-minute load average is recorded before and after.
Results: a table on stdout and JSON in benchmarks/results/cpu_replicas.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
RESULTS = os.path.join(_HERE, "results", "cpu_replicas.json")
GLOBAL_BATCH = 120
DEVICES = 8
CONFIGS = (("expframe", "expframe"), ("plain", "tf_default"), ("expframe", "tf_default"),
           ("plain", "expframe_threads"), ("expframe", "intra1"))
QUICK_CONFIGS = CONFIGS[:2]


# -- worker --------------------------------------------------------------------------------

def _set_threads(tf, threads: str, replicas: int) -> None:
    cores = os.cpu_count() or 1
    if threads == "intra1":  # expframe's inter-op rule, one thread per op once the replicas fill the cores
        if replicas >= cores:
            tf.config.threading.set_intra_op_parallelism_threads(1)
    elif threads == "tf_default":
        tf.config.threading.set_inter_op_parallelism_threads(cores)
        tf.config.threading.set_intra_op_parallelism_threads(cores)
    elif threads == "expframe_threads":  # what expframe's cpu target sets for 8 replicas
        tf.config.threading.set_inter_op_parallelism_threads(max(cores, 2 * DEVICES))


def graph_ops(concrete) -> dict:
    """The size of a traced host call: TensorFlow ops in its function bodies (the steps'
    loop), in total and on the busiest device. An op costs the executor about the same
    whatever its size, so this counts the per-step overhead that replicas multiply."""
    per_device = {}
    for function in concrete.graph.as_graph_def().library.function:
        for node in function.node_def:
            device = node.device.rsplit("device:", 1)[-1] if node.device else "unplaced"
            per_device[device] = per_device.get(device, 0) + 1
    placed = [count for device, count in per_device.items() if device != "unplaced"]
    return {"total": sum(per_device.values()), "busiest_device": max(placed, default=0),
            "unplaced": per_device.get("unplaced", 0)}


def worker(args) -> None:
    """One process: one runner on `args.replicas` replicas with one thread setting."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, _HERE)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    _set_threads(tf, args.threads, args.replicas)
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    import expframe  # pylint: disable=import-outside-toplevel
    import handwritten  # pylint: disable=import-outside-toplevel
    from expframe.layers import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    from expframe.models.resnet import resnet  # pylint: disable=import-outside-toplevel
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

    n = args.replicas
    if args.runner == "expframe":
        task = ClassificationTask(model=model, dataset=lambda split, ctx, batch_size, **_: dataset(batch_size),
                                  optimizer=lambda: keras.optimizers.Adam(2e-3), eval_split=None)
        trainer = Trainer(train_steps=10 ** 9, global_batch_size=GLOBAL_BATCH)
        trainer.prepare(expframe.Replicator("cpu", n), task, seed=0, deterministic=False)
        call = lambda k: trainer.run_train_steps(k)["loss"]  # noqa: E731
        traced = lambda k: trainer.rep._step_loops[task.train_step].get_concrete_function(  # noqa: E731
            trainer.train_iterator, tf.constant(k, tf.int32))  # pylint: disable=protected-access
    else:
        physical = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(physical, [tf.config.LogicalDeviceConfiguration()] * DEVICES)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")[:n]]
        strategy = tf.distribute.MirroredStrategy(devices=devices)
        with strategy.scope():
            net, opt = model(), keras.optimizers.Adam(2e-3)
        call = handwritten.handwritten_loop(strategy, net, opt, dataset, GLOBAL_BATCH, 10)
        traced = call.traced
    threads = {"inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
               "intra_op": tf.config.threading.get_intra_op_parallelism_threads()}
    for _ in range(2):  # trace, then once more untimed
        call(args.steps_per_call)
    ops = graph_ops(traced(args.steps_per_call))
    wall, cpu = [], []
    for _ in range(args.calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = call(args.steps_per_call)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if not np.isfinite(loss):
            raise RuntimeError(f"loss {loss}")
    examples = args.steps_per_call * GLOBAL_BATCH
    print("RESULT " + json.dumps({
        "runner": args.runner, "replicas": n, "threads_setting": args.threads, "threads": threads, "graph_ops": ops,
        "examples_per_sec": examples / statistics.median(wall),
        "cpu_us_per_example": 1e6 * statistics.median(cpu) / examples, "wall_s": wall, "cpu_s": cpu}), flush=True)


# -- driver --------------------------------------------------------------------------------

def run_config(args, runner: str, replicas: int, threads: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--role=worker", f"--runner={runner}",
           f"--replicas={replicas}", f"--threads={threads}", f"--steps_per_call={args.steps_per_call}",
           f"--calls={args.calls}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    for name in ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS", "EXPFRAME_CPU_DEVICES"):
        env.pop(name, None)
    try:
        # Not through expframe.processes: a short worker whose output is captured, ended by
        # subprocess.run at its timeout; and importing the package here would put its
        # allocator default (TF_CPU_ALLOCATOR_USE_BFC) into the environment of workers that
        # measure plain TensorFlow.
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"runner": runner, "replicas": replicas, "threads_setting": threads, "error": "timed out"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"runner": runner, "replicas": replicas, "threads_setting": threads,
                "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:200]}"}
    return json.loads(lines[-1][len("RESULT "):])


def summarise(records: list) -> list:
    """One row per (runner, thread setting): medians over repeats at 1 and 8 replicas, and 8/1."""
    rows = []
    for runner, threads in dict.fromkeys((r["runner"], r["threads_setting"]) for r in records):
        row = {"runner": runner, "threads_setting": threads}
        for n in (1, DEVICES):
            mine = [r for r in records if (r["runner"], r["threads_setting"], r["replicas"]) == (runner, threads, n)
                    and "error" not in r]
            if mine:
                row[n] = {"examples_per_sec": statistics.median(r["examples_per_sec"] for r in mine),
                          "cpu_us_per_example": statistics.median(r["cpu_us_per_example"] for r in mine),
                          "threads": mine[0]["threads"], "graph_ops": mine[0].get("graph_ops")}
        if 1 in row and DEVICES in row:
            row["ratio_8_over_1"] = row[DEVICES]["examples_per_sec"] / row[1]["examples_per_sec"]
            row["cpu_ratio_8_over_1"] = row[DEVICES]["cpu_us_per_example"] / row[1]["cpu_us_per_example"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="expframe and the plain loop only, 1 repeat")
    parser.add_argument("--role", choices=("driver", "worker"), default="driver")
    parser.add_argument("--runner", choices=("expframe", "plain"), default="expframe")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", default="expframe",
                        choices=("expframe", "intra1", "tf_default", "expframe_threads"))
    parser.add_argument("--steps_per_call", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--configs", nargs="+", default=None, help="runner:threads pairs, e.g. expframe:intra1")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    args.steps_per_call = args.steps_per_call or (5 if args.quick else 8)
    if args.steps_per_call < 2:  # graph_ops counts the step loop's function bodies
        parser.error("--steps_per_call must be at least 2: a one-step host call has no step loop to count")
    args.calls = args.calls or (5 if args.quick else 7)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.role == "worker":
        worker(args)
        return 0
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    if args.configs:
        configs = [tuple(c.split(":")) for c in args.configs]
    sys.path.insert(0, ROOT)
    from expframe import provenance  # pylint: disable=import-outside-toplevel  (no TensorFlow)
    from machine import write_result  # pylint: disable=import-outside-toplevel  (benchmarks/machine.py)

    load_before, started = os.getloadavg()[0], time.time()
    print(f"quickstart model, global batch {GLOBAL_BATCH}, {args.steps_per_call} steps per call, {args.calls} "
          f"calls per process, {args.repeats} repeat(s); {os.cpu_count()} CPUs, load average {load_before:.2f}",
          flush=True)
    records = []
    for r in range(args.repeats):
        for runner, threads in configs:
            for n in ((1, DEVICES) if r % 2 == 0 else (DEVICES, 1)):
                record = run_config(args, runner, n, threads)
                records.append(record)
                shown = record.get("error") or (f"{record['examples_per_sec']:8.1f} examples/s, "
                                                f"{record['cpu_us_per_example']:7.0f} CPU us/example, "
                                                f"threads {record['threads']}")
                print(f"  repeat {r + 1}: {runner:>8} {threads:>16} x{n}: {shown}", flush=True)
    rows = summarise(records)
    load_after = os.getloadavg()[0]
    print(f"\n{'runner':>8} {'threads':>16} | {'ex/s x1':>8} {'ex/s x8':>8} {'8/1':>6} | "
          f"{'CPU us/ex x1':>12} {'x8':>6} {'8/1':>6} | {'ops/call x1':>11} {'x8':>6} {'x8 busiest':>10}")
    for row in rows:
        if "ratio_8_over_1" not in row:
            print(f"{row['runner']:>8} {row['threads_setting']:>16} | incomplete (see above)")
            continue
        one, eight = row[1], row[DEVICES]
        print(f"{row['runner']:>8} {row['threads_setting']:>16} | {one['examples_per_sec']:>8.1f} "
              f"{eight['examples_per_sec']:>8.1f} {row['ratio_8_over_1']:>6.3f} | {one['cpu_us_per_example']:>12.0f} "
              f"{eight['cpu_us_per_example']:>6.0f} {row['cpu_ratio_8_over_1']:>6.2f} | "
              f"{one['graph_ops']['total']:>11} {eight['graph_ops']['total']:>6} "
              f"{eight['graph_ops']['busiest_device']:>10}")
    print(f"1-minute load average {load_before:.2f} before, {load_after:.2f} after; {time.time() - started:.0f} s")
    result = {"benchmark": "cpu_replicas", "model": "quickstart (ResNet-8, SyncBatchNorm)",
              "global_batch": GLOBAL_BATCH, "devices": DEVICES, "steps_per_call": args.steps_per_call,
              "calls": args.calls, "repeats": args.repeats, "rows": rows, "records": records,
              "load_average_1min": {"before": load_before, "after": load_after},
              "machine": provenance.machine(),
              "wall_s": round(time.time() - started, 1)}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
