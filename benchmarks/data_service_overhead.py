"""What the tf.data service costs the shipped ImageNet train pipeline, on this machine (issue 62).

    python benchmarks/data_service_overhead.py            # 512 JPEGs, 30 interleaved repeats (about 3 min)
    python benchmarks/data_service_overhead.py --quick    # 32 JPEGs, batch 8, 1 repeat: that it runs

Two cores cannot show the service's point (more cores than the host has); they show its
cost. Both runners build the shipped train pipeline (`imagenet_input('train')`, batch 32,
224 px, float32) on benchmarks/imagenet_input.py's generated ImageNet-like records, on one
tf.data thread (the same options as that benchmark), and read `--per_repeat` images:

  in_process  as a trainer reads it without the service;
  service     as `Trainer.data_service` reads it: the pipeline of shard 0 of 1 (the
              input_fn's stream, built with `ctx.step_shard`), prepared by a dispatcher and
              its worker in this process (`data_service.start_shard`: 127.0.0.1, gRPC) and
              read through `tf.data.experimental.service.distribute` (parallel_epochs), as
              expframe/replicator/data_service.py does.

The ratio service / in_process of images/s, paired repeat by repeat, is the overhead with
a 95 % interval (per-element serialization, the gRPC copy of each 19 MB batch, the client's
buffer); images per process CPU-second says what the service's own work costs in CPU.

Also measured, once: why the service's own modes were not taken. `distributed_epoch`
(dynamic sharding) over 2 workers of one dispatcher, 3 runs of the same 64-element
dataset: the runs' orders, compared (expframe's shards give the input's order; see
expframe/replicator/data_service.py).

Results: a table on stdout naming the CPU, JSON in benchmarks/results/data_service_overhead.json.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

import imagenet_input as bench  # noqa: E402  (sets the environment, splits nothing)
from expframe.data import imagenet  # noqa: E402
from expframe.replicator import data_service  # noqa: E402
from expframe.replicator.inputs import InputContext  # noqa: E402
from expframe.reproduce import spread  # noqa: E402
from machine import cpu_name, load_average, machine  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "data_service_overhead.json")
_service = tf.data.experimental.service


def shipped(config: dict, step_shard=None) -> tf.data.Dataset:
    ctx = InputContext(1, 0, 1, 0, step_shard)
    ds = imagenet.imagenet_input("train", ctx, batch_size=config["batch"], seed=bench.SEED,
                                 data_dir=config["data_dir"], image_size=config["image_size"])
    return ds.with_options(bench.thread_options(1))


def served(config: dict, dispatcher) -> tf.data.Dataset:
    """The pipeline as shard 0 of 1, read the way Trainer.data_service reads its shards."""
    address = dispatcher.target.split("://", 1)[1]
    return data_service.DataService([address], "this benchmark").serve([shipped(config, (0, 1, config["batch"]))])


def distributed_epoch_orders(runs: int = 3, elements: int = 64) -> dict:
    """The orders `distributed_epoch` gives over 2 workers of one dispatcher, `runs` times."""
    dispatcher = _service.DispatchServer(_service.DispatcherConfig(port=0))
    address = dispatcher.target.split("://", 1)[1]
    workers = [_service.WorkerServer(_service.WorkerConfig(dispatcher_address=address, port=0)) for _ in range(2)]
    work = tf.random.uniform([20_000])  # a little work per element, so that the workers interleave

    ds = tf.data.Dataset.range(elements).map(lambda x: x + tf.cast(tf.reduce_sum(work) * 0, tf.int64))
    orders = []
    for _ in range(runs):
        got = ds.apply(_service.distribute(processing_mode="distributed_epoch", service=dispatcher.target))
        orders.append([int(x) for x in got.as_numpy_iterator()])
    del workers
    return {"elements": elements, "runs": runs, "every_element_once": all(sorted(o) == list(range(elements))
                                                                          for o in orders),
            "orders_equal": all(o == orders[0] for o in orders),
            "in_input_order": [o == list(range(elements)) for o in orders],
            "positions_differing_from_run_1": [int(sum(a != b for a, b in zip(o, orders[0], strict=True)))
                                               for o in orders[1:]]}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="32 JPEGs, batch 8, 1 repeat of 32 images")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--per_repeat", type=int, default=None, help="images timed per runner and repeat (256)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    n, repeats = (32, 1) if args.quick else (512, args.repeats or spread.REPEATS)
    config = {"batch": 8 if args.quick else 32, "image_size": 224,
              "per_repeat": args.per_repeat or (32 if args.quick else 256), "warmup": 2}
    absl_logging.set_verbosity(absl_logging.WARNING)
    tfds.disable_progress_bar()
    started, load_start = time.perf_counter(), load_average() or [0.0]
    scratch = tempfile.mkdtemp(prefix="data_service_overhead_")
    try:
        print(f"{cpu_name()}, {os.cpu_count()} CPUs; TensorFlow {tf.__version__}", flush=True)
        jpegs, data = bench.make_jpegs(n)
        data_dir, manual = os.path.join(scratch, "tfds"), os.path.join(scratch, "manual")
        bench.write_manual_dir(manual, jpegs, imagenet._builder(data_dir).info.features["label"].names)
        bench.prepare(data_dir, manual, bench.shards_for(n))
        config["data_dir"] = data_dir
        dispatcher, _worker = data_service.start_shard()
        datasets = {"in_process": shipped(config), "service": served(config, dispatcher)}
        for ds in datasets.values():  # first iterators, file caches, kernels: not timed
            bench.time_once(ds, config["warmup"], config["batch"])
        samples = {name: {"seconds": [], "images": [], "cpu_s": []} for name in datasets}
        names = list(datasets)
        for i in range(repeats):
            for name in names[i % 2:] + names[:i % 2]:
                seconds, images, cpu = bench.time_once(datasets[name], config["warmup"], config["per_repeat"])
                for key, value in zip(("seconds", "images", "cpu_s"), (seconds, images, cpu), strict=True):
                    samples[name][key].append(value)
        modes = distributed_epoch_orders()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rates = {name: [i / s for i, s in zip(v["images"], v["seconds"], strict=True)] for name, v in samples.items()}
    per_cpu = {name: [i / c for i, c in zip(v["images"], v["cpu_s"], strict=True) if c > 0]
               for name, v in samples.items()}
    ratio = spread.of([s / p for s, p in zip(rates["service"], rates["in_process"], strict=True)])
    print(f"{'runner':<11} {'images/s (95% interval)':>26} {'images per CPU-s':>17}")
    for name in names:
        found = spread.of(rates[name])
        print(f"{name:<11} {found['median']:>10.1f} ({found['low']:.1f}-{found['high']:.1f})"
              f"{np.median(per_cpu[name]):>17.1f}")
    print(f"service / in_process, images/s (paired, {repeats} repeats): {ratio['median']:.3f} "
          f"({ratio['low']:.3f}-{ratio['high']:.3f})")
    print(f"distributed_epoch over 2 workers, {modes['runs']} runs of {modes['elements']} elements: every element "
          f"once {modes['every_element_once']}, the same order every run {modes['orders_equal']}, in the input's "
          f"order {modes['in_input_order']}")
    result = {"benchmark": "data_service_overhead", "quick": args.quick, "repeats": repeats, "config":
              {k: v for k, v in config.items() if k != "data_dir"}, "data": data,
              "runners": {name: {"images_per_sec": spread.of(rates[name]),
                                 "images_per_cpu_second": float(np.median(per_cpu[name] or [0.0])), **samples[name]}
                          for name in names},
              "service_over_in_process": ratio, "spread": {"service_over_in_process": ratio},
              "distributed_epoch": modes, "machine": machine(), "tensorflow": tf.__version__,
              "load_average": {"start": load_start, "end": load_average() or [0.0]},
              "wall_s": round(time.perf_counter() - started, 1)}
    bench.write_and_report(args.out, result)


if __name__ == "__main__":
    main()
