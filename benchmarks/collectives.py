"""All-reduce on N logical CPU replicas versus a plain copy of the same bytes.

    python benchmarks/collectives.py            # 4 KB .. 64 MB, 2 and 4 replicas
    python benchmarks/collectives.py --quick    # a few seconds: small sizes, few repeats

For each size it times `expframe.all_reduce(x, "sum")` inside `Replicator.run` inside
one `tf.function` (the Replicator's `cpu` target), and, interleaved with it in the same
loop, two copies of the same bytes: numpy `np.copyto` into a preallocated array, and a
TF op that must write a new buffer (`x * s` with `s` a runtime scalar, which grappler
cannot fold away like `x + 0` or `tf.identity`). It also times the same all-reduce under
other `cross_device_ops` of a MirroredStrategy over the same devices, to show which
reduction the `cpu` target should use. Medians over repeats (default 30); a table on
stdout and JSON in `benchmarks/results/collectives.json`. Each row also holds, per
reduction, the spread of its paired ratios (sample i of the all-reduce / sample i of the
numpy copy, taken one after the other in the same repeat): `spread` maps
`<variant>_over_copy_numpy` to its minimum, median, maximum and 95 % bootstrap interval
of the median (expframe/reproduce/spread.py).

Goal (the issue): all-reduce of 64 MB across 2 CPU replicas within 3x one copy (a cost:
lower is better; a regression when the whole interval is above 3).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from expframe.reproduce import spread  # numpy only: TensorFlow is not started here

# Imported by _import_tf(), after the allocator is chosen: TensorFlow reads
# TF_CPU_ALLOCATOR_USE_BFC once, when its CPU allocator is first created.
tf = None
expframe = None

KB, MB = 1 << 10, 1 << 20
SIZES = (4 * KB, 64 * KB, 1 * MB, 16 * MB, 64 * MB)
REPLICAS = (2, 4)
GOAL_SIZE, GOAL_REPLICAS, GOAL_RATIO = 64 * MB, 2, 3.0
DEFAULT = "replicator"  # expframe.Replicator('cpu', n): what the framework uses.
# TF's default CPU allocator hands large buffers back to the OS on free, so every new
# 64 MB output page-faults 16k fresh pages; its BFC allocator (opt-in by env) reuses them.
ALLOCATORS = {"tf_default": "false", "bfc": "true"}


def _import_tf(allocator):
    global tf, expframe  # pylint: disable=global-statement
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = ALLOCATORS[allocator]
    import tensorflow  # pylint: disable=g-import-not-at-top

    import expframe as xf  # pylint: disable=g-import-not-at-top
    tf, expframe = tensorflow, xf


def _variants(devices):
    """name -> a MirroredStrategy over `devices` (None: the Replicator's own)."""
    from tensorflow.python.distribute import cross_device_ops as cdo  # pylint: disable=g-import-not-at-top
    from tensorflow.python.distribute import cross_device_utils  # pylint: disable=g-import-not-at-top

    def collective_ring():
        # What MultiWorkerMirroredStrategy uses, here over the local logical CPUs.
        return cdo.CollectiveAllReduce(
            devices=devices, group_size=len(devices),
            options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING),
            # Group keys must not collide with those of another device set in this process.
            collective_keys=cross_device_utils.CollectiveKeys(group_key_start=1 + 1000 * len(devices)))

    return {
        DEFAULT: None,
        "reduce_to_first_device": lambda: tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0]),
        "reduce_to_host_cpu": lambda: tf.distribute.ReductionToOneDevice(reduce_to_device="/cpu:0"),
        "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
        "collective_ring": collective_ring,  # 5-70x slower on CPU: not in the default list.
    }


class AllReduceCase:
    """A compiled all-reduce of one per-replica float32 tensor of `size` bytes."""

    def __init__(self, strategy, size):
        self.strategy = strategy
        n = size // 4
        self.x = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.fill([n], tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0))

        def step(x):
            return expframe.all_reduce(x, "sum")

        @tf.function
        def all_reduce(x):
            return strategy.run(step, args=(x,))
        self.fn = all_reduce
        got = strategy.experimental_local_results(self.fn(self.x))
        expected = sum(range(1, strategy.num_replicas_in_sync + 1))
        assert all(float(g[0]) == expected and float(g[-1]) == expected for g in got), got

    def __call__(self):
        return self.fn(self.x)


class TfCopy:
    """`x * s` on one device: reads and writes `size` bytes, as a copy does."""

    def __init__(self, size, device):
        with tf.device(device):
            self.x = tf.fill([size // 4], 1.0)
            self.s = tf.Variable(1.0)

        @tf.function
        def scale(x):
            with tf.device(device):
                return x * self.s
        self.fn = scale
        self.fn(self.x)

    def __call__(self):
        return self.fn(self.x)


class NpCopy:
    def __init__(self, size):
        self.src = np.ones(size // 4, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)

    def __call__(self):
        np.copyto(self.dst, self.src)


def _time(fn, inner):
    start = time.perf_counter()
    for _ in range(inner):
        out = fn()
    del out
    return (time.perf_counter() - start) / inner


def _inner(size):
    """Calls per sample, so each sample lasts long enough to time (> ~5 ms)."""
    return max(1, min(50, (4 * MB) // size))


def _human(size):
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def run(sizes, replicas, repeats, variants):
    results = []
    for n in replicas:
        rep = expframe.Replicator("cpu", n)
        devices = list(rep.strategy.extended.worker_devices)
        builders = _variants(devices)
        strategies = {}
        for name in variants:
            try:
                strategies[name] = rep.strategy if builders[name] is None else tf.distribute.MirroredStrategy(
                    devices, cross_device_ops=builders[name]())
            except Exception as e:  # pylint: disable=broad-except
                print(f"  {name} on {n} replicas: unavailable ({type(e).__name__}: {str(e)[:100]})")
        for size in sizes:
            cases = {"copy_numpy": NpCopy(size), "copy_tf": TfCopy(size, devices[0])}
            for name, strategy in strategies.items():
                try:
                    cases[name] = AllReduceCase(strategy, size)
                except Exception as e:  # pylint: disable=broad-except
                    print(f"  {name}, {_human(size)} on {n} replicas: failed "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            inner = _inner(size)
            samples = {name: [] for name in cases}
            for _ in range(repeats):  # interleaved: drift and neighbours hit all alike.
                for name, fn in cases.items():
                    samples[name].append(_time(fn, inner))
            med = {name: statistics.median(s) for name, s in samples.items()}
            paired = {f"{k}_over_copy_numpy": spread.of([a / b for a, b in zip(v, samples["copy_numpy"], strict=True)])
                      for k, v in samples.items() if not k.startswith("copy")}
            row = {"size_bytes": size, "replicas": n, "repeats": repeats, "calls_per_sample": inner,
                   "median_s": med,
                   "ratio_to_copy_numpy": {k: v / med["copy_numpy"] for k, v in med.items()
                                           if not k.startswith("copy")},
                   "ratio_to_copy_tf": {k: v / med["copy_tf"] for k, v in med.items()
                                        if not k.startswith("copy")},
                   "spread": paired}
            results.append(row)
            _print_row(row, variants)
            del cases
    return results


def _print_header(variants):
    names = "".join(f"{v[:22]:>24}" for v in variants)
    print(f"{'size':>6} {'rep':>3} {'np copy':>9} {'tf copy':>9}{names}")
    print(f"{'':>6} {'':>3} {'ms':>9} {'ms':>9}" + f"{'ms (x np, x tf)':>24}" * len(variants))


def _print_row(row, variants):
    med = row["median_s"]
    cells = ""
    for v in variants:
        if v in med:
            cells += f"{med[v] * 1e3:>9.3f} ({row['ratio_to_copy_numpy'][v]:>5.1f}, " \
                     f"{row['ratio_to_copy_tf'][v]:>5.1f})"
        else:
            cells += f"{'-':>24}"
    print(f"{_human(row['size_bytes']):>6} {row['replicas']:>3} {med['copy_numpy'] * 1e3:>9.3f} "
          f"{med['copy_tf'] * 1e3:>9.3f}{cells}", flush=True)


def _measure(args):
    """One allocator, in this process."""
    _import_tf(args.allocator)
    sizes = (4 * KB, 1 * MB) if args.quick else SIZES
    variants = args.variants.split(",")
    expframe.split_cpu(max(REPLICAS))
    tf.get_logger().setLevel("ERROR")  # one tf.function per case: retracing warnings are expected.
    print(f"allocator {args.allocator} (TF_CPU_ALLOCATOR_USE_BFC={ALLOCATORS[args.allocator]}): "
          f"all-reduce (sum) of float32 on N logical CPU replicas vs one copy; median of "
          f"{args.repeats}; {os.cpu_count()} CPU cores, TF {tf.__version__}")
    _print_header(variants)
    results = run(sizes, REPLICAS, args.repeats, variants)
    summary = {}
    goal = next((r for r in results if r["size_bytes"] == GOAL_SIZE and r["replicas"] == GOAL_REPLICAS),
                None)
    if goal:
        ratios = goal["ratio_to_copy_numpy"]
        best = min(ratios, key=ratios.get)
        found = goal["spread"][f"{DEFAULT}_over_copy_numpy"]
        summary = {"ratio": ratios[DEFAULT], "met": ratios[DEFAULT] <= GOAL_RATIO,
                   "paired": found["median"], "interval": [found["low"], found["high"]],
                   "verdict": spread.verdict(found, spread.at_most(GOAL_RATIO)),
                   "fastest_variant": best, "fastest_ratio": ratios[best]}
        print(f"goal ({args.allocator}): 64 MB on 2 replicas, {DEFAULT} = {ratios[DEFAULT]:.2f}x np copy "
              f"({'met' if summary['met'] else 'MISSED'}, goal <= {GOAL_RATIO}x); paired {found['median']:.2f}x, "
              f"95% interval {found['low']:.2f}-{found['high']:.2f}: {summary['verdict']}; "
              f"fastest: {best} = {ratios[best]:.2f}x")
    return {"allocator": args.allocator, "tensorflow": tf.__version__, "summary": summary,
            "results": results}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke run)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="samples per measurement (default 30: expframe/reproduce/spread.py's REPEATS)")
    parser.add_argument("--variants", default="replicator,reduce_to_first_device,reduce_to_host_cpu,"
                        "hierarchical_copy",
                        help="comma-separated reductions to compare; also: collective_ring")
    parser.add_argument("--allocator", choices=["both"] + list(ALLOCATORS), default="both",
                        help="TF CPU allocator; 'both' runs one process per allocator")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results", "collectives.json"))
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else spread.REPEATS)
    if args.allocator != "both":
        runs = [_measure(args)]
    else:  # one fresh process per allocator: the choice is fixed at TF start-up.
        runs = []
        for allocator in ALLOCATORS:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "run.json")
                cmd = [sys.executable, os.path.abspath(__file__), f"--allocator={allocator}",
                       f"--repeats={args.repeats}", f"--variants={args.variants}", f"--out={out}"]
                # Its own session, stopped with this script (each run sets its allocator itself).
                from expframe import processes  # pylint: disable=import-outside-toplevel
                processes.run(cmd + (["--quick"] if args.quick else []), f"collectives {allocator}", capture=False,
                              check=True)
                with open(out) as f:
                    runs.extend(json.load(f)["runs"])
    from machine import write_result  # pylint: disable=import-outside-toplevel  (benchmarks/machine.py)
    write_result(args.out, {"benchmark": "collectives", "quick": args.quick, "cpu_count": os.cpu_count(),
                            "platform": platform.platform(), "python": sys.version.split()[0],
                            "goal": f"64 MB all-reduce on 2 CPU replicas <= {GOAL_RATIO}x one np copy",
                            "runs": runs}, indent=1)


if __name__ == "__main__":
    main()
