"""SyncBatchNorm designs on N logical CPU replicas: time of a step and exactness of the variance.

    python benchmarks/sync_batch_norm.py            # 2 to 32 replicas, 30 repeats: ~45 min on 2 cores
    python benchmarks/sync_batch_norm.py --quick    # 2 and 4 replicas, 8 layers, 3 repeats: ~1 min

A step runs ResNet-50's 53 batch-norm layers (their channel counts, 64 to 2048) on a
tiny spatial size (2 x 2, 2 images per replica), forward and backward, each layer's
input depending on the previous layer's output as in a network (so each layer's
collectives wait for the last's). Designs, interleaved in every repeat:

  plain          keras BatchNormalization: per-replica moments (its moving statistics
                 averaged over replicas by Replicator.scope())
  shipped        SyncBatchNorm: one all-reduce of (count, S1, S2) around the moving mean,
                 a second of the centred squares where the shift is far (never here
                 after the first step), a hand-written backward of one all-reduce
  gather         the design before issue 59: an all_gather of every replica's (count,
                 mean, M2), merged with Chan's formula (O(N C) per replica)
  two_pass       all-reduce (count, sum), then the squares about that mean (2 collectives)
  broadcast      replica 0's local mean broadcast as the shift, then one all-reduce
                 (2 collectives)
  unshifted      one all-reduce of (count, sum, sum of squares): E[x^2] - E[x]^2, what
                 TF-Replicator and Keras' synchronized=True compute (inexact, for time)

and with groups of 2 replicas (4 replicas and up): `groups` (shipped: each group's
moving statistics, averaged over the replicas at every update by Replicator.scope(),
as MLPerf's TPU code follows its groups) against `groups_whole` (the whole batch's,
the same on every replica by one more all-reduce of the shifted sums beside the
group's). From 16 replicas on, only plain,
shipped, gather and the two grouped designs (tracing is most of the time). Each
replica count runs in a process of its own (a process splits its CPU once). Per repeat, one step of each design; the
figure is the paired ratio design / plain (seconds; lower is better) with its spread
(expframe/reproduce/spread.py). Exactness: each design's variance on 4 x 256 values of
mean 1e3 and std 1, around a far shift (moving mean 0, the first step) and a near one
(moving mean 999.5), relative to float64. JSON: benchmarks/results/sync_batch_norm.json.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/machine.py and this checkout's expframe
from expframe.reproduce import spread  # noqa: E402  (numpy only)
from machine import ROOT, load_average, machine, write_result  # noqa: E402

RESULTS = os.path.join(HERE, "results", "sync_batch_norm.json")
REPLICAS = (2, 4, 8, 16, 32)
# ResNet-50 v1.5's 53 batch norms, in order: the stem, then per stage (blocks x (C, C, 4C),
# the first block's projection 4C).
RESNET50_CHANNELS = tuple([64] + [c for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512)))
                                  for c in [width, width, 4 * width, 4 * width]
                                  + [width, width, 4 * width] * (blocks - 1)])
DESIGNS = ("plain", "shipped", "gather", "two_pass", "broadcast", "unshifted")
GROUPED = ("groups", "groups_whole")
# Tracing 53 layers on every replica takes about 7 s per replica and design on 2 cores: from
# 16 replicas on, only the designs the figures compare.
LARGE, LARGE_DESIGNS = 16, ("plain", "shipped", "gather", "groups", "groups_whole")


def designs_at(n: int) -> list:
    """The designs timed on n replicas (groups of 2 from 4 replicas)."""
    names = list(DESIGNS) + (list(GROUPED) if n >= 4 else [])
    return [d for d in names if n < LARGE or d in LARGE_DESIGNS]


# -- the designs (worker side; TensorFlow imported there) -------------------------------------

def designs():
    """name -> a batch-norm layer class; every one but plain is a SyncBatchNorm with its own moments."""
    # pylint: disable=import-outside-toplevel
    import keras
    import tensorflow as tf

    import expframe as xf
    from expframe.layers import cross_replica_moments as crm
    from expframe.replicator import collectives
    from expframe.replicator.replicator import identical_updates

    def local(x, axes):
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        mean = tf.reduce_mean(x, axis=axes)
        m2 = tf.reduce_sum(tf.square(x - tf.reshape(mean, crm.keep_shape(x.shape.rank, axes))), axis=axes)
        return count, mean, m2

    class Gather(xf.layers.SyncBatchNorm):
        """Before issue 59: gather every replica's (count, mean, M2), merge with Chan's formula."""

        def _moments(self, inputs, mask):
            axes = list(self._reduction_axes)
            count, mean, m2 = local(inputs, axes)
            c = mean.shape[0]
            table = collectives.all_gather(tf.concat([tf.fill([c], count), mean, m2], axis=0)[None], axis=0)
            counts, means, m2s = table[:, :c], table[:, c:2 * c], table[:, 2 * c:]
            total = tf.reduce_sum(counts, axis=0)
            merged = tf.reduce_sum(counts * means, axis=0) / total
            m2 = tf.reduce_sum(m2s, axis=0) + tf.reduce_sum(counts * tf.square(means - merged), axis=0)
            return merged, m2 / total

    class TwoPass(xf.layers.SyncBatchNorm):
        def _moments(self, inputs, mask):
            axes = list(self._reduction_axes)
            c = inputs.shape[-1]
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
            total = collectives.all_reduce(tf.concat([[count], tf.reduce_sum(inputs, axis=axes)], 0), "sum")
            mean = total[1:] / total[0]
            centred = inputs - tf.reshape(tf.stop_gradient(mean), crm.keep_shape(inputs.shape.rank, axes))
            m2 = collectives.all_reduce(tf.reduce_sum(tf.square(centred), axis=axes), "sum")
            del c
            return mean, m2 / total[0]

    class Broadcast(xf.layers.SyncBatchNorm):
        def _moments(self, inputs, mask):
            axes = list(self._reduction_axes)
            shift = tf.stop_gradient(collectives.broadcast(tf.reduce_mean(inputs, axis=axes), 0))
            return _shifted(inputs, axes, shift)

    class Unshifted(xf.layers.SyncBatchNorm):
        def _moments(self, inputs, mask):
            axes = list(self._reduction_axes)
            return _shifted(inputs, axes, tf.zeros([inputs.shape[-1]]))

    def _shifted(x, axes, shift):
        count, s1, s2 = crm.local_sums(x, axes, None, shift)
        c = s1.shape[0]
        total = collectives.all_reduce(tf.concat([count, s1, s2], axis=0), "sum")
        d = total[1:1 + c] / total[0]
        return shift + d, tf.maximum(total[1 + c:] / total[0] - tf.square(d), 0.0)

    class GroupsWhole(xf.layers.SyncBatchNorm):
        """Groups whose moving statistics follow the whole batch: the same every replica by
        one more all-reduce of the shifted sums over all replicas, beside the group's (the
        design shipped before the groups' average was measured)."""

        def build(self, input_shape):
            with identical_updates():
                keras.layers.BatchNormalization.build(self, input_shape)

        def call(self, inputs, training=None, mask=None):
            x, axes = inputs, list(self._reduction_axes)
            mean, var = crm.moments(x, axes, mask, self.moving_mean, self._group())
            whole_mean, whole_var = _shifted(tf.stop_gradient(x), axes, crm._value(self.moving_mean))  # noqa: SLF001
            self.moving_mean.assign(self.moving_mean * self.momentum + whole_mean * (1.0 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum + whole_var * (1.0 - self.momentum))
            return keras.ops.batch_normalization(x, mean, var, axis=self.axis, offset=self.beta, scale=self.gamma,
                                                 epsilon=self.epsilon)

    import functools
    return {"plain": keras.layers.BatchNormalization, "shipped": xf.layers.SyncBatchNorm, "gather": Gather,
            "two_pass": TwoPass, "broadcast": Broadcast, "unshifted": Unshifted,
            "groups": functools.partial(xf.layers.SyncBatchNorm, group_size=2),
            "groups_whole": functools.partial(GroupsWhole, group_size=2)}


def _stack_step(rep, layer_cls, channels, per_replica):
    """A tf.function running the chain of batch norms forward and backward on every replica."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with rep.scope():
        layers = [layer_cls(momentum=0.9) for _ in channels]
        for layer, c in zip(layers, channels, strict=True):
            layer.build((per_replica, 2, 2, c))

    def step(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss, carry = 0.0, 0.0
            for layer, x in zip(layers, xs, strict=True):
                y = layer(x + 1e-3 * carry, training=True)  # each layer waits for the last one
                carry = tf.reduce_mean(y)
                loss += tf.reduce_sum(y * x)
        return tape.gradient(loss, xs)[-1]

    return tf.function(lambda v: rep.run(step, v))


def _exactness(rep, layer_cls):
    """Relative error of the batch variance (mean 1e3, std 1, 256 per replica) around a
    far shift (moving mean 0) and a near one (999.5), on this process's replicas (at most 4)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    out = {}
    n = rep.num_replicas
    parts = [np.random.default_rng(r).normal(1000.0, 1.0, size=(1024 // n, 4)).astype(np.float32) for r in range(n)]
    want = np.concatenate(parts).astype(np.float64).var(0)
    for name, shift in (("far", 0.0), ("near", 999.5)):
        with rep.scope():
            layer = layer_cls(momentum=0.0)
            layer.build((None, 4))
            layer.moving_mean.assign([shift] * 4)
        tf.function(lambda v, layer=layer: rep.run(lambda x: layer(x, training=True), v))(
            rep.strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group])))
        got = np.asarray(rep.local_results(layer.moving_variance.value)[0], np.float64)
        out[name] = float(np.max(np.abs(got - want) / want))
    return out


def worker(args) -> dict:
    """One replica count: build every design, time them interleaved, print RESULT json."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import expframe as xf  # pylint: disable=import-outside-toplevel
    xf.split_cpu(args.replicas)
    n, per_replica = args.replicas, 2
    channels = RESNET50_CHANNELS[:args.layers] if args.layers else RESNET50_CHANNELS
    rep = xf.Replicator(target="cpu", num_replicas=n)
    classes = designs()
    names = designs_at(n)
    rng = np.random.default_rng(0)
    data = [rng.normal(2.0, 3.0, size=(n, per_replica, 2, 2, c)).astype(np.float32) for c in channels]
    inputs = rep.strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.constant(d[ctx.replica_id_in_sync_group]) for d in data])
    steps, built = {}, {}
    for name in names:
        start = time.perf_counter()
        steps[name] = _stack_step(rep, classes[name], channels, per_replica)
        for _ in range(2):  # trace, then one warm step
            rep.local_results(steps[name](inputs))
        built[name] = time.perf_counter() - start
    samples = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            start = time.perf_counter()
            [t.numpy() for t in rep.local_results(steps[name](inputs))]  # noqa: B018 (wait for the step)
            samples[name].append(time.perf_counter() - start)
    exact = {name: _exactness(xf.Replicator(target="cpu", num_replicas=min(n, 4)), classes[name])
             for name in DESIGNS if name != "plain"} if args.exactness else {}
    return {"replicas": n, "layers": len(channels), "per_replica_batch": per_replica, "seconds": samples,
            "build_s": built, "exactness": exact}


# -- driver -----------------------------------------------------------------------------------

def _run_worker(args, n):
    from expframe import processes  # pylint: disable=import-outside-toplevel
    cmd = [sys.executable, os.path.abspath(__file__), "--role=worker", f"--replicas={n}",
           f"--repeats={args.repeats}", f"--layers={args.layers}"] + (["--exactness"] if n == 4 else [])
    done = processes.run(cmd, f"sync_batch_norm on {n} replicas", cwd=ROOT, timeout=args.timeout,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"worker on {n} replicas failed ({done.returncode}):\n" + done.stdout[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def summarise(record: dict) -> dict:
    """Per design: median seconds, and the paired ratio to plain with its spread; and the
    paired ratios shipped / gather and groups / groups_whole."""
    seconds = record["seconds"]
    out = {}
    for name, values in seconds.items():
        out[name] = {"median_s": float(sorted(values)[len(values) // 2]),
                     "over_plain": spread.of([v / p for v, p in zip(values, seconds["plain"], strict=True)])}
    for a, b in (("shipped", "gather"), ("groups", "groups_whole")):
        if a in seconds and b in seconds:
            out[a][f"over_{b}"] = spread.of([x / y for x, y in zip(seconds[a], seconds[b], strict=True)])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 replicas, 3 repeats")
    parser.add_argument("--role", choices=("driver", "worker"), default="driver")
    parser.add_argument("--replicas", default=None, help="comma-separated counts (worker: one)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--layers", type=int, default=0, help="the first L of ResNet-50's batch norms (0: all 53)")
    parser.add_argument("--exactness", action="store_true", help="worker: also measure each design's variance")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per replica count")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else spread.REPEATS
    if args.role == "worker":
        args.replicas = int(args.replicas)
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    counts = [int(n) for n in args.replicas.split(",")] if args.replicas else ([2, 4] if args.quick else REPLICAS)
    if args.quick and not args.layers:
        args.layers = 8
    started, load_before = time.time(), load_average()
    records = []
    for n in counts:
        record = _run_worker(args, n)
        record["summary"] = summarise(record)
        records.append(record)
        cells = "  ".join(f"{k} {v['over_plain']['median']:.2f}x [{v['over_plain']['low']:.2f}, "
                          f"{v['over_plain']['high']:.2f}]" for k, v in record["summary"].items() if k != "plain")
        print(f"{n:3d} replicas  plain {record['summary']['plain']['median_s'] * 1e3:8.1f} ms  {cells}", flush=True)
        if record["exactness"]:
            print("    variance error vs float64 (far shift, near shift): " + ", ".join(
                f"{k} {v['far']:.1e} {v['near']:.1e}" for k, v in record["exactness"].items()), flush=True)
    result = {"benchmark": "SyncBatchNorm designs, ResNet-50's 53 batch norms at 2x2, forward and backward",
              "quick": args.quick, "repeats": args.repeats, "results": records,
              "load_average": {"before": load_before, "after": load_average()}, "machine": machine(),
              "wall_time_s": round(time.time() - started, 1)}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
