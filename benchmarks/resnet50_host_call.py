"""What a ResNet-50 host call's structure costs: expframe with and without its gradient
packing, the hand-written loop with and without its step loop, and Keras fit, timed
interleaved in one process.

    python benchmarks/resnet50_host_call.py                         # 128 px, 2 replicas, 30 repeats
    python benchmarks/resnet50_host_call.py --size 224 --repeats 30
    python benchmarks/resnet50_host_call.py --size 32 --repeats 2   # a smoke run

The five runners, one step per call at global batch 4, float32 (the setting of the
benchmarks set's resnet50_throughput):

  expframe           the Trainer's host call (benchmarks/resnet50_throughput.py), as shipped;
  expframe_unpacked  the same with the small-gradient packing of
                     expframe/replicator/collectives.py turned off (every gradient its own
                     reduction), set while it is traced;
  handwritten        benchmarks/handwritten.py: a `tf.range` step loop in the call;
  handwritten_noloop one step per tf.function call and no loop in the graph, as `fit`
                     runs at steps_per_execution = 1;
  keras_fit          `model.fit` (benchmarks/resnet50_throughput.py).

Every runner is timed as fit times itself, on the second of two calls in a row
(resnet50_throughput.timed_call). Each pair is a paired ratio of speeds over the
repeats, with its spread (min, median, max and a 95 % bootstrap interval of the
median, expframe/reproduce/spread.py).
docs/resnet50.md quotes the 2026-12-06 figures. JSON goes to --out.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import tensorflow as tf  # noqa: E402  pylint: disable=wrong-import-position

import handwritten  # noqa: E402  pylint: disable=wrong-import-position
import resnet50_throughput as rt  # noqa: E402  pylint: disable=wrong-import-position
from expframe.replicator import collectives  # noqa: E402  pylint: disable=wrong-import-position
from expframe.reproduce import spread  # noqa: E402  pylint: disable=wrong-import-position

PAIRS = (("expframe", "expframe_unpacked"), ("expframe", "handwritten"), ("expframe", "keras_fit"),
         ("handwritten_noloop", "handwritten"), ("handwritten_noloop", "keras_fit"), ("handwritten", "keras_fit"))


class NoLoopRunner:
    """The hand-written step with no loop: one `strategy.run` per tf.function call; with
    `nested`, the replicated step and its reduction in a nested tf.function, the shape of
    Keras fit's host call at steps_per_execution = 1 (benchmarks/fit_gap.py)."""

    def __init__(self, cfg: rt.Setup, nested: bool = False):
        strategy = handwritten.baseline_strategy(cfg.strategy_kind, cfg.num_replicas, cfg.target)
        with strategy.scope():
            model, optimizer = rt.build_model(cfg.size, cfg.depth), rt.build_optimizer()
        step, self.iterator = handwritten.replica_step(
            strategy, model, optimizer,
            lambda per_replica: tf.data.Dataset.from_tensors(rt.synthetic_batch(per_replica, cfg.size)).repeat(),
            cfg.global_batch, rt.NUM_CLASSES)

        def replicated(batch):
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(step, args=(batch,)), axis=None)
        inner = tf.function(replicated) if nested else replicated

        @tf.function
        def one(iterator):
            return inner(next(iterator))

        self.one = one

    def __call__(self):
        start = time.perf_counter()
        loss = float(self.one(self.iterator))
        return loss, time.perf_counter() - start


def build(cfg: rt.Setup) -> dict:
    """The five runners, each traced and run twice (not timed)."""
    built = {}
    packing = collectives._PACK_MAX_ELEMENTS  # pylint: disable=protected-access
    for name, limit in (("expframe", packing), ("expframe_unpacked", 0)):
        collectives._PACK_MAX_ELEMENTS = limit  # pylint: disable=protected-access
        try:
            built[name] = rt.ExpframeRunner(cfg)
            built[name]()  # traced here, with this packing
        finally:
            collectives._PACK_MAX_ELEMENTS = packing  # pylint: disable=protected-access
    built["handwritten"] = rt.HandwrittenRunner(cfg)
    built["handwritten_noloop"] = NoLoopRunner(cfg)
    built["keras_fit"] = rt.KerasFitRunner(cfg)
    for runner in built.values():
        runner()
        runner()
    return built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=spread.REPEATS)
    parser.add_argument("--out", default=os.path.join(_HERE, "results", "resnet50_host_call.json"))
    args = parser.parse_args(argv)
    cfg = rt.Setup(args.size, args.replicas, "float32", 4, 1)
    load_start = os.getloadavg()[0]
    built = build(cfg)
    names = list(built)
    times = {name: [] for name in names}
    for i in range(args.repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate who goes first
            times[name].append(rt.timed_call(built[name])[1])  # each the second of two calls in a row
    print(f"{rt.cpu_name()}, {os.cpu_count()} CPUs; ResNet-50 at {args.size} px on {args.replicas} replica(s), "
          f"batch 4, one step per call, {args.repeats} interleaved repeats")
    for name in names:
        print(f"  {name:<19} {statistics.median(times[name]):.4f} s per call (median)")
    ratios = {}
    for a, b in PAIRS:
        s = spread.of([tb / ta for ta, tb in zip(times[a], times[b], strict=True)])
        ratios[f"{a}_over_{b}"] = s
        print(f"  {a} / {b} (speed): {s['median']:.3f}, 95% interval {s['low']:.3f} to {s['high']:.3f}")
    print(f"1-minute load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"size": args.size, "replicas": args.replicas, "repeats": args.repeats, "times_s": times,
                   "spread": ratios, "cpu": rt.cpu_name(), "machine": platform.platform()}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
