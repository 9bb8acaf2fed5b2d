"""ResNet-50 through expframe and through Keras fit, each in a process of its own, as users run them.

    python benchmarks/own_process.py --sizes 128 --replicas 1     # 6 processes, 30 interleaved repeats
    python benchmarks/own_process.py --sizes 224 128 --replicas 1 2 --runners expframe keras_fit keras_fit_xf

resnet50_throughput.py and fit_gap.py time every runner in one process, so they share
its threads and allocator: they compare the code, never what a process is set up with.
A researcher compares `python main.py` with a Keras script, two processes. Here each
runner is a long-lived process of its own (`--worker`), built and traced once, then
told by this one over a pipe to run one host call at a time, in rotating order, while
the others wait idle on their pipes: interleaved and paired as the in-process
benchmarks are. The runners (same ResNet-50, synthetic batch, SGD as resnet50_throughput.py;
batch 4, one step per call; the default three: expframe, expframe_before, keras_fit):

  expframe         the Trainer's host call in a process set up as main.py sets it up:
                   run_experiment splits the CPU into the replicas it binds
                   (`split_only_for`), the `cpu` Replicator sizes the inter-op pool by
                   them (expframe/replicator/targets.py: inter_op_threads), with the BFC
                   allocator `import expframe` selects.
  expframe_before  the same as expframe set it up before issue 61: 8 logical devices
                   whatever the replicas, and max(cores, 2 x 8) = 16 inter-op threads.
  keras_fit        `model.fit` in a process as a Keras user writes it: TensorFlow's default
                   threads (inter-op = intra-op = the cores) and allocator, no strategy on
                   one replica, `tf.distribute.MirroredStrategy` over 2 logical CPU devices
                   on two.
  keras_fit_xf     fit in a process set up as expframe's (its threads, devices, allocator
                   and the Replicator's strategy): the set-up swapped, as issue 61 asks.
  expframe_malloc  expframe with TensorFlow's default allocator instead of BFC.

Every runner is timed as fit times itself (resnet50_throughput.py's KerasFitRunner: from
the end of its first execution to the end of its second): the second of two host calls
in a row, caches and threads warm. Timed on a call that followed the other processes'
calls, as this benchmark first did, expframe / keras_fit was 0.951 (0.938-0.973) at
128 px on one replica and 0.744 (0.697-0.770) at ResNet-8 32 px; timed alike, 0.992
(0.963-1.012) and 0.959 (0.938-1.003) (one sitting, 2-core Xeon; docs/resnet50.md).

Every runner has two processes, built in mirrored order (A B C C B A), and is timed on
the faster of the two (by their median call). In every sitting, one of the processes
built first ran 9-20 % slower than its copy, whichever runner it was (ResNet-50 128 px,
one replica, medians of 30 calls: 0.443 against 0.374 s; 0.415 against 0.364; with one
more untimed process built before them, 0.375 against 0.343), while the copies of the
other runners agreed within 3 %. Summing both processes, as this benchmark first did,
put that slowness on whichever runner was named first: expframe, on the results page
of the first sitting (its ratios there are low by up to 7 %).

Results: a table (images/s; expframe's paired speed over each runner's with a 95 %
bootstrap interval of the median, expframe/reproduce/spread.py), and JSON in
benchmarks/results/own_process_<precision>.json.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNNERS = ("expframe", "expframe_before", "keras_fit", "keras_fit_xf", "expframe_malloc")


def _worker(name: str, size: int, replicas: int, precision: str, depth: int) -> None:
    """One runner's process: set up as `name` says, then one timed host call per line read."""
    sys.path[:0] = [ROOT, HERE]
    if name in ("keras_fit", "expframe_malloc"):
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "false"   # before `import expframe` sets it
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if name == "expframe_before":
        tf.config.threading.set_inter_op_parallelism_threads(max(os.cpu_count() or 1, 16))
    if name == "keras_fit":  # as a user splits the CPU for MirroredStrategy (one device: as it is); threads left alone
        physical = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(physical, [tf.config.LogicalDeviceConfiguration()] * replicas)
    else:  # what main.py does: the first Replicator splits the CPU and sizes the pool
        import expframe  # pylint: disable=import-outside-toplevel
        from expframe.replicator import split_only_for  # pylint: disable=import-outside-toplevel
        if name != "expframe_before":  # run_experiment splits only the replicas it binds
            split_only_for(replicas)
        expframe.Replicator("cpu", replicas)
    import keras  # pylint: disable=import-outside-toplevel

    import resnet50_throughput as rt  # pylint: disable=import-outside-toplevel  (its split is then a no-op)
    keras.mixed_precision.set_global_policy(precision)
    fit_kind = ("none" if replicas == 1 else "tf_default") if name == "keras_fit" else "same"
    cfg = rt.Setup(size, replicas, precision, 4, 1, depth=depth, fit_strategy_kind=fit_kind)
    runner = (rt.ExpframeRunner if name.startswith("expframe") else rt.KerasFitRunner)(cfg)
    for _ in range(2):  # trace; the second call of a fresh function was seen to take longer
        runner()
    info = {"inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "allocator_bfc": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
            "logical_cpus": len(tf.config.list_logical_devices("CPU"))}
    print(json.dumps({"ready": info}), flush=True)
    for line in sys.stdin:
        if line.strip() != "call":
            break
        loss, seconds = rt.timed_call(runner)  # as fit times itself: the second of two calls in a row
        print(json.dumps({"seconds": seconds, "loss": float(loss)}), flush=True)


def _read(proc, name: str) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"runner {name} ended: exit {proc.wait()}")
        if line.startswith("{"):
            return json.loads(line)


def measure(size: int, replicas: int, precision: str, depth: int, repeats: int, names) -> dict:
    """One setting: two processes per runner, built in the order names + reversed(names),
    then `repeats` rounds of one call per process in rotating order. A runner's seconds
    in a round are those of its faster process (by median; the module docstring says why)."""
    from expframe.reproduce import spread  # pylint: disable=import-outside-toplevel
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for key in ("EXPFRAME_CPU_DEVICES", "TF_NUM_INTEROP_THREADS", "TF_CPU_ALLOCATOR_USE_BFC"):
        env.pop(key, None)
    order = [(name, 0) for name in names] + [(name, 1) for name in reversed(names)]
    procs, info = {}, {}
    try:
        for key in order:  # built one at a time: each build has the cores to itself
            procs[key] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", key[0], "--size", str(size),
                 "--replicas", str(replicas), "--precision", precision, "--depth", str(depth)],
                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            info[f"{key[0]}#{key[1]}"] = _read(procs[key], key[0])["ready"]
        ready = "; ".join(f"{k} inter-op {v['inter_op']}, BFC {v['allocator_bfc']}, {v['max_rss_gb']:.1f} GB"
                          for k, v in info.items())
        print(f"  {len(procs)} processes ready: {ready}", flush=True)
        calls = {key: [] for key in order}
        for i in range(repeats):
            for key in order[i % len(order):] + order[:i % len(order)]:
                procs[key].stdin.write("call\n")
                procs[key].stdin.flush()
                calls[key].append(_read(procs[key], key[0])["seconds"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait(timeout=120)
    def median(values):
        return sorted(values)[len(values) // 2]
    faster = {name: min((0, 1), key=lambda c, n=name: median(calls[(n, c)])) for name in names}
    times = {name: calls[(name, faster[name])] for name in names}
    out = {"size": size, "replicas": replicas, "precision": precision, "processes": info, "runners": {}}
    for name in names:
        entry = {"images_per_sec": 4 / median(times[name]), "median_s_per_call": median(times[name]),
                 "timed_process": faster[name], "times_s": {str(c): calls[(name, c)] for c in (0, 1)},
                 "median_s_per_process": [median(calls[(name, c)]) for c in (0, 1)]}
        if name != "expframe" and "expframe" in names:
            entry["expframe_over"] = spread.of([t / e for e, t in zip(times["expframe"], times[name], strict=True)])
        out["runners"][name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1], choices=(1, 2))
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--depth", type=int, default=50, help="ResNet depth (50; a small one for a smoke run)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS[:3]))
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=RUNNERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.sizes[0], args.replicas[0], args.precision, args.depth)
        return
    sys.path[:0] = [ROOT, HERE]
    from machine import cpu_name, machine, write_result  # pylint: disable=import-outside-toplevel
    names, started, load_start = tuple(args.runners), time.perf_counter(), os.getloadavg()[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; ResNet-{args.depth}, {args.precision}, batch 4, one step per "
          f"call, {args.repeats} interleaved repeats, two processes per runner", flush=True)
    print(f"{'size':>4} {'rep':>3} {'runner':>15} | {'images/s':>8} {'s/call':>7} | {'expframe / runner (95%)':>25}",
          flush=True)
    out = {"benchmark": "own_process", "precision": args.precision, "depth": args.depth, "repeats": args.repeats,
           "runners": names, "machine": machine(), "settings": []}
    path = args.out or os.path.join(HERE, "results", f"own_process_{args.precision}.json")
    for size in args.sizes:
        for replicas in args.replicas:
            setting = measure(size, replicas, args.precision, args.depth, args.repeats, names)
            out["settings"].append(setting)
            for name, entry in setting["runners"].items():
                found = entry.get("expframe_over")
                cell = f"{found['median']:>9.3f} ({found['low']:.3f}-{found['high']:.3f})" if found else "-"
                print(f"{size:>4} {replicas:>3} {name:>15} | {entry['images_per_sec']:>8.2f} "
                      f"{entry['median_s_per_call']:>7.3f} | {cell:>25}", flush=True)
            out["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
            out["wall_s"] = time.perf_counter() - started
            write_result(path, out, say=False)  # after every setting: a long run stopped early keeps what it measured
    print(f"wrote {path}; 1-minute load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
