"""Weak scaling on CPU cores: 2 workers (or 2 replicas) versus 1, same batch per worker.

    python benchmarks/scaling.py            # ~19 min on 2 idle cores: 3 configurations x 6 repeats, a TF start-up each
    python benchmarks/scaling.py --quick    # 1 repeat, shorter timings (7 min measured on a loaded 2-core box)

Trains a CIFAR ResNet-20 (`resnet(depth=20, num_classes=10, input_shape=(32, 32, 3))`)
on synthetic in-memory data, 64 examples per worker per step, with the framework's
own pieces: `expframe.Replicator` for the strategy, `Replicator.distribute` for the
input and `expframe.wrap_optimizer` for the gradient all-reduce. Every process uses
one intra-op thread per core it owns and is pinned with `os.sched_setaffinity`.

Two comparisons, each reporting examples/s over all workers and the weak-scaling
efficiency = throughput(2) / (2 x throughput(1)) (goal >= 0.90):

* multi_worker: 1 process on core 0 (target 'cpu', 1 replica) versus 2 processes on
  cores 0 and 1, a MultiWorkerMirroredStrategy cluster on 127.0.0.1 from `TF_CONFIG`
  (target 'multi_worker', ring all-reduce between the processes).
* local: 1 process on core 0 with 1 replica versus 1 process on cores 0-1 with 2
  replicas (target 'cpu': MirroredStrategy over 2 logical CPU devices).

Each configuration runs `--repeats` times (default 6), interleaved; each repeat gives
a paired efficiency (its 2-worker run over 2 x its 1-worker run), and the figure is
their median with their spread (`spread`: minimum, median, maximum and a 95 %
bootstrap interval of the median, expframe/reproduce/spread.py): it meets the goal when
the whole interval is at or above 0.90, and is a regression when all of it is below.
The machine must be otherwise idle for the numbers to mean anything: the script prints
the 1-minute load average before and after. JSON goes to
`benchmarks/results/scaling.json`.

This script is also its own worker program (`--role=worker`), started by the driver.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
RESULTS = os.path.join(_HERE, "results", "scaling.json")
PER_WORKER_BATCH = 64
GOAL = 0.90


# -- worker --------------------------------------------------------------------------------

def worker(args) -> None:
    """One process: trains ResNet-20 and prints `RESULT {json}` with its examples/s."""
    cores = [int(c) for c in args.cores.split(",")]
    os.sched_setaffinity(0, cores)  # before TensorFlow starts its thread pools.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(1)
    # Room for the replicas' ops to run side by side, plus a collective's send/recv.
    tf.config.threading.set_inter_op_parallelism_threads(args.replicas + 1)
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    import expframe  # pylint: disable=import-outside-toplevel
    from expframe.models.resnet import resnet  # pylint: disable=import-outside-toplevel

    keras.utils.set_random_seed(0)
    if os.environ.get("TF_CONFIG"):
        rep = expframe.Replicator("multi_worker")
    else:
        rep = expframe.Replicator("cpu", args.replicas)
    global_batch = PER_WORKER_BATCH * rep.num_replicas  # weak scaling: 64 per replica, 1 replica per core
    per_replica = global_batch // rep.num_replicas
    with rep.scope():
        model = resnet(depth=20, num_classes=10, input_shape=(32, 32, 3))
        opt = expframe.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9))

    rng = np.random.default_rng(rep.worker_index)
    images = tf.constant(rng.standard_normal((per_replica, 32, 32, 3)), tf.float32)
    labels = tf.constant(rng.integers(0, 10, per_replica), tf.int32)

    def input_fn(ctx):
        assert ctx.get_per_replica_batch_size(global_batch) == per_replica
        return tf.data.Dataset.from_tensors({"image": images, "label": labels}).repeat()

    it = iter(rep.distribute(input_fn, global_batch_size=global_batch))

    def step_fn(batch):
        with tf.GradientTape() as tape:
            logits = model(batch["image"], training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                batch["label"], logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train(iterator, n):
        loss = rep.reduce(rep.run(step_fn, iterator.get_next()), "mean")
        for _ in tf.range(n - 1):
            loss = rep.reduce(rep.run(step_fn, iterator.get_next()), "mean")
        return loss

    steps = tf.constant(args.steps_per_call, tf.int32)
    for _ in range(args.warmup_calls):
        float(train(it, steps))
    rates = []
    for _ in range(args.calls):
        start = time.perf_counter()
        loss = float(train(it, steps))
        rates.append(args.steps_per_call * PER_WORKER_BATCH * args.replicas / (time.perf_counter() - start))
    record = {"worker": rep.worker_index, "target": rep.target, "replicas_in_sync": rep.num_replicas,
              "global_batch": global_batch, "examples_per_sec": statistics.median(rates),
              "rates": rates, "loss": loss, "cores": cores}
    print("RESULT " + json.dumps(record), flush=True)


# -- driver --------------------------------------------------------------------------------

def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _worker_args(args, cores, replicas):
    return [sys.executable, os.path.abspath(__file__), "--role=worker", f"--cores={cores}",
            f"--replicas={replicas}", f"--steps_per_call={args.steps_per_call}",
            f"--warmup_calls={args.warmup_calls}", f"--calls={args.calls}"]


def _run(commands, envs, timeout):
    """Runs processes together; returns their RESULT records (examples/s each)."""
    # Each in a session of its own; every group is stopped on any way out (expframe.processes).
    from expframe import processes  # pylint: disable=import-outside-toplevel
    records = []
    with processes.Owner("benchmarks/scaling") as owner:
        children = [owner.start(c, f"worker {i}", env=e, cwd=_ROOT)
                    for i, (c, e) in enumerate(zip(commands, envs, strict=True))]
        deadline = time.monotonic() + timeout
        for child in children:
            code = owner.reap(child, timeout=max(deadline - time.monotonic(), 0.1))
            lines = [line for line in child.tail if line.startswith("RESULT ")]
            if code != 0 or not lines:
                raise RuntimeError(f"worker failed (status {code}):\n" + "\n".join(list(child.tail)[-40:]))
            records.append(json.loads(lines[-1][len("RESULT "):]))
    return records


def measure(args, config):
    """examples/s over all workers for one configuration name."""
    base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    base.pop("TF_CONFIG", None)
    if config == "one":  # one worker, one core, one replica
        records = _run([_worker_args(args, "0", 1)], [base], args.timeout)
    elif config == "local2":  # one process, two cores, two replicas (MirroredStrategy)
        records = _run([_worker_args(args, "0,1", 2)], [base], args.timeout)
    elif config == "multi_worker2":  # two processes, one core each (MultiWorkerMirroredStrategy)
        # A chief plus a worker: two workers as TF_CONFIG names them on real clusters.
        ports = _free_ports(2)
        cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
        tasks = [{"type": "chief", "index": 0}, {"type": "worker", "index": 0}]
        envs = [dict(base, TF_CONFIG=json.dumps({"cluster": cluster, "task": t})) for t in tasks]
        records = _run([_worker_args(args, str(i), 1) for i in range(2)], envs, args.timeout)
    else:
        raise ValueError(config)
    return sum(r["examples_per_sec"] for r in records), records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, shorter timings")
    parser.add_argument("--role", choices=("driver", "worker"), default="driver")
    parser.add_argument("--cores", default="0", help="worker: CPU cores to pin to, e.g. 0 or 0,1")
    parser.add_argument("--replicas", type=int, default=1, help="worker: local replicas")
    parser.add_argument("--steps_per_call", type=int, default=None)
    parser.add_argument("--warmup_calls", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    defaults = dict(steps_per_call=(5, 10), warmup_calls=(1, 2), calls=(3, 5), repeats=(1, 6))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.role == "worker":
        worker(args)
        return 0

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or cores[:2] != [0, 1]:
        print(f"note: this process may use cores {cores}; the workers pin to cores 0 and 1", file=sys.stderr)
    load_before = os.getloadavg()[0]
    configs = ("one", "multi_worker2", "local2")
    runs = {c: [] for c in configs}
    started = time.time()
    for r in range(args.repeats):
        for c in configs:  # interleaved, so slow drifts hit every configuration alike.
            total, records = measure(args, c)
            runs[c].append({"examples_per_sec": total, "workers": records})
            print(f"repeat {r + 1}/{args.repeats}  {c:14s} {total:8.1f} examples/s", flush=True)
    median = {c: statistics.median(x["examples_per_sec"] for x in runs[c]) for c in configs}
    from expframe.reproduce import spread  # pylint: disable=import-outside-toplevel
    paired = {name: [two["examples_per_sec"] / (2 * one["examples_per_sec"])
                     for one, two in zip(runs["one"], runs[config], strict=True)]
              for name, config in (("multi_worker", "multi_worker2"), ("local_replicas", "local2"))}
    spreads = {name: spread.of(values) for name, values in paired.items()}
    eff = {name: found["median"] for name, found in spreads.items()}  # median of the paired efficiencies
    eff_of_medians = {"multi_worker": median["multi_worker2"] / (2 * median["one"]),
                      "local_replicas": median["local2"] / (2 * median["one"])}
    load_after = os.getloadavg()[0]

    print(f"\nResNet-20, {PER_WORKER_BATCH} examples per worker per step, 1 intra-op thread per core")
    print(f"{'configuration':40s} {'examples/s':>11s}")
    print(f"{'1 worker, 1 core':40s} {median['one']:11.1f}")
    print(f"{'2 workers (multi_worker), 1 core each':40s} {median['multi_worker2']:11.1f}")
    print(f"{'2 local replicas (cpu), 2 cores':40s} {median['local2']:11.1f}")
    for name, value in eff.items():
        found = spreads[name]
        print(f"scaling efficiency {name:15s} {value:.3f}  (95% interval {found['low']:.3f}-{found['high']:.3f} "
              f"over {found['n']} repeats; goal >= {GOAL:.2f}: {spread.verdict(found, spread.at_least(GOAL))})")
    print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after "
          f"({os.cpu_count()} CPUs; numbers are only meaningful on an idle machine)")

    result = {
        "benchmark": "weak scaling, ResNet-20 on synthetic 32x32 data",
        "per_worker_batch": PER_WORKER_BATCH,
        "settings": {k: getattr(args, k) for k in ("quick", "steps_per_call", "warmup_calls", "calls", "repeats")},
        "examples_per_sec": median,
        "scaling_efficiency": eff,
        "efficiency_of_medians": eff_of_medians,
        "spread": spreads,
        "goal": GOAL,
        "runs": runs,
        "load_average_1min": {"before": load_before, "after": load_after},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_time_s": round(time.time() - started, 1),
    }
    from machine import write_result  # pylint: disable=import-outside-toplevel  (benchmarks/machine.py)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
