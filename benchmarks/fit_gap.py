"""Where Keras fit's lead over expframe at ResNet-50 comes from: one change at a time.

    python benchmarks/fit_gap.py --size 128 --replicas 2            # every variant, 30 repeats
    python benchmarks/fit_gap.py --variants expframe keras_fit hw_fit_shape

The same ResNet-50, batch, optimizer, strategy and synthetic in-memory batch as
benchmarks/resnet50_throughput.py (one step per host call, float32 unless
--precision), built once per variant and timed interleaved in one process
(one call each, in rotating order, `--repeats` rounds; each the second of two calls
in a row, as fit times itself: resnet50_throughput.timed_call), each variant's
seconds paired with keras_fit's and with expframe's. Every variant moves one
thing from one runner towards another:

  expframe        the Trainer's host call, as resnet50_throughput times it.
  handwritten     the tf.distribute guide's loop (benchmarks/handwritten.py).
  keras_fit       `model.fit`, its steady-state execution timed.
  hw_fit_shape    handwritten's step in fit's host call: no `tf.range` loop, the
                  replicated step and its reduction in a nested tf.function.
  keras_step      Keras' own `model.train_step` (compiled model: loss tracker,
                  Keras' gradient summing) in handwritten's host call, on fit's
                  distributed dataset of (image, label) pairs.
  xf_step_loop    expframe's one-step host call with the `tf.range` step loop around
                  its step, as before issue 61 (expframe now runs a one-step call
                  without it: Replicator._one_step_form).
  xf_fit_shape    expframe's host call in fit's shape: the replica step a nested
                  tf.function inside `strategy.run` (1 replica only: on more, the
                  nested function cannot hold the step's cross-replica reduction).
  xf_mean_stats   expframe as it was before issue 61: batch norm's moving statistics
                  one copy by MEAN aggregation (a cross-replica mean at every assign,
                  one per variable).
  xf_mean_grads   expframe's gradients as before issue 61: summed over the replicas,
                  then divided by their number (one more pass over every gradient),
                  instead of 1/N fed into the backward pass as Keras fit feeds it.
  xf_before_61    xf_mean_stats, xf_mean_grads and xf_step_loop at once: expframe as it
                  was before issue 61.
  xf_local_stats  expframe with batch norm's moving statistics left per replica (no
                  average at all), as plain Keras under a strategy leaves them: what
                  one copy costs (expframe/replicator/statistics.py).
  xf_unpacked     expframe's gradient all-reduce without packing small gradients
                  into one buffer (one reduction per gradient).
  keras_fit_b, expframe_b
                  a second keras_fit and expframe, built after the others: whether the
                  build order alone moves a runner (issue 61: it did not).

Threading is process-wide (one inter-op and one intra-op pool for every logical
device), so every variant in one run already shares it; `--inter_op N` sets the
inter-op pool for the whole run (expframe sets max(cores, 2 x replicas) when it
splits the CPU; this benchmark splits it for 2: 4 here). How the process is set up
(threads, allocator) is measured apart, a process per runner: benchmarks/own_process.py.

Results: a table on stdout (images/s, and each variant's paired speed over
keras_fit's and over expframe's with a 95 % bootstrap interval of the median)
and JSON in benchmarks/results/fit_gap_<size>px_<n>rep_<precision>.json.
"""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--inter_op", type=int, default=0)
_inter_op = _pre.parse_known_args()[0].inter_op
if _inter_op:  # before expframe splits the CPU (and sets its own pool size)
    import tensorflow as _tf
    _tf.config.threading.set_inter_op_parallelism_threads(_inter_op)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import handwritten  # noqa: E402
import resnet50_host_call  # noqa: E402
import resnet50_throughput as rt  # noqa: E402  (splits the CPU into 2 logical devices)
from expframe.replicator import collectives, statistics, xla_steps  # noqa: E402
from expframe.replicator import optimizer as optimizer_module  # noqa: E402
from expframe.replicator import replicator as replicator_module  # noqa: E402
from expframe.reproduce import spread  # noqa: E402
from machine import cpu_name, machine, write_result  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class _Patched:
    """Sets module attributes while a runner is built and traced, then puts them back."""

    def __init__(self, changes):
        self.changes, self.saved = changes, []

    def __enter__(self):
        self.saved = [(m, k, getattr(m, k)) for m, k, _ in self.changes]
        for module, name, value in self.changes:
            setattr(module, name, value)

    def __exit__(self, *exc):
        for module, name, value in self.saved:
            setattr(module, name, value)


class PatchedExpframe:
    """expframe's runner, built and traced (its first call) with `changes` in place."""

    changes = ()

    def __init__(self, cfg):
        self.cfg = cfg
        with _Patched(self.changes):
            self.runner = rt.ExpframeRunner(cfg)
            self.runner()  # traced here, under the change

    def __call__(self):
        return self.runner()


class XfStepLoop(PatchedExpframe):
    """expframe before its one-step form: a `tf.range` loop around the one step."""
    changes = ((replicator_module.Replicator, "_one_step_form", lambda self, step_fn, num_steps: False),)


class XfFitShape(PatchedExpframe):
    """expframe's host call in fit's shape: the replica step a nested tf.function."""
    changes = ((xla_steps.XlaSteps, "replica_step", lambda self, step_fn: tf.function(step_fn)),)


def _mean_aggregated(self, next_creator, **kwargs):
    """The creator before issue 61: statistics get MEAN aggregation (averaged at every assign)."""
    if statistics._is_statistic(kwargs):  # pylint: disable=protected-access
        kwargs["aggregation"] = tf.VariableAggregation.MEAN
    return next_creator(**kwargs)


class XfMeanStatistics(PatchedExpframe):
    changes = ((statistics.Statistics, "creator", _mean_aggregated),
               (statistics.Statistics, "step", lambda self, step_fn: step_fn))


def _minimize_dividing_after(self, loss, variables, tape=None):
    """ReplicatedOptimizer.minimize before issue 61 (no loss scaling, as here): the
    gradients of the loss, averaged over the replicas by a mean all-reduce (a sum, then a
    division of every gradient)."""
    variables = list(variables)
    self.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    return loss


class XfMeanGradients(PatchedExpframe):
    changes = ((optimizer_module.ReplicatedOptimizer, "minimize", _minimize_dividing_after),)


class XfBefore61(PatchedExpframe):
    changes = XfMeanStatistics.changes + XfMeanGradients.changes + XfStepLoop.changes


class XfLocalStatistics(PatchedExpframe):
    changes = ((statistics.Statistics, "step", lambda self, step_fn: step_fn),)


class XfUnpacked(PatchedExpframe):
    changes = ((collectives, "_PACK_MAX_ELEMENTS", 0),)


class HwFitShape(resnet50_host_call.NoLoopRunner):
    """handwritten's replica step in fit's host call (one step, nested tf.function)."""

    def __init__(self, cfg):
        super().__init__(cfg, nested=True)


class KerasStep:
    """Keras' compiled `train_step` in handwritten's host call, on fit's input."""

    def __init__(self, cfg):
        strategy = handwritten.baseline_strategy(cfg.strategy_kind, cfg.num_replicas, cfg.target)
        with strategy.scope():
            model = rt.build_model(cfg.size, cfg.depth)
            model.compile(optimizer=rt.build_optimizer(),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
            model.optimizer.build(model.trainable_variables)
        batch = rt.synthetic_batch(cfg.global_batch, cfg.size)
        self.iterator = iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((batch["image"], batch["label"])).repeat()))

        @tf.function
        def loop(iterator, k):
            logs = strategy.run(model.train_step, args=(next(iterator),))
            for _ in tf.range(k - 1):
                logs = strategy.run(model.train_step, args=(next(iterator),))
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, logs["loss"], axis=None)

        self.loop, self.steps = loop, cfg.steps

    def __call__(self):
        start = time.perf_counter()
        loss = float(self.loop(self.iterator, tf.constant(self.steps)))
        return loss, time.perf_counter() - start


VARIANTS = {"expframe": rt.ExpframeRunner, "handwritten": rt.HandwrittenRunner, "keras_fit": rt.KerasFitRunner,
            "hw_fit_shape": HwFitShape, "keras_step": KerasStep, "xf_step_loop": XfStepLoop,
            "xf_fit_shape": XfFitShape,
            "xf_mean_stats": XfMeanStatistics, "xf_mean_grads": XfMeanGradients, "xf_before_61": XfBefore61,
            "xf_local_stats": XfLocalStatistics, "xf_unpacked": XfUnpacked,
            "keras_fit_b": rt.KerasFitRunner, "expframe_b": rt.ExpframeRunner}

# A replica step in a nested tf.function cannot hold a cross-replica reduction (merge_call).
ONE_REPLICA_ONLY = {"xf_fit_shape"}


def _announced(name, cls):
    """`cls`, printing when an instance is built and when its first call (the trace) is done."""
    class Announced:
        def __init__(self, cfg):
            start = time.perf_counter()
            self.runner, self.first = cls(cfg), True
            print(f"  built {name} in {time.perf_counter() - start:.0f} s", flush=True)

        def __call__(self):
            out = self.runner()
            if self.first:
                self.first = False
                print(f"  {name}: first call {out[1]:.1f} s", flush=True)
            return out

        def __getattr__(self, attr):
            return getattr(self.runner, attr)
    return Announced


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[_pre])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--global_batch_size", type=int, default=4)
    parser.add_argument("--depth", type=int, default=50, help="ResNet depth (50; a small one for a smoke run)")
    parser.add_argument("--repeats", type=int, default=spread.REPEATS)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                        help="default: every variant that runs at --replicas (xf_fit_shape: 1 replica only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.variants is None:
        args.variants = [v for v in VARIANTS if args.replicas == 1 or v not in ONE_REPLICA_ONLY]
    elif args.replicas > 1 and ONE_REPLICA_ONLY & set(args.variants):
        parser.error(f"--variants {' '.join(sorted(ONE_REPLICA_ONLY & set(args.variants)))} runs on --replicas 1 "
                     "only: its nested tf.function cannot hold the step's cross-replica reduction")
    names = tuple(args.variants)
    rt.RUNNER_CLASSES.update({k: _announced(k, VARIANTS[k]) for k in names})
    cfg = rt.Setup(args.size, args.replicas, args.precision, args.global_batch_size, 1, depth=args.depth)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, inter-op threads "
          f"{tf.config.threading.get_inter_op_parallelism_threads()}; ResNet-{args.depth} {args.size} px, "
          f"{args.replicas} replica(s), {args.precision}, batch {args.global_batch_size}, one step per call, "
          f"{args.repeats} interleaved repeats", flush=True)
    row = rt.measure(cfg, args.repeats, names)
    times = {n: row[n]["times_s"] for n in names}
    out = {"benchmark": "fit_gap", "setup": cfg._asdict(), "repeats": args.repeats,
           "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
           "machine": machine(), "tensorflow": tf.__version__, "keras": keras.__version__,
           "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]}, "variants": {}}
    print(f"{'variant':>13} | {'images/s':>8} {'s/call':>7} | {'speed / keras_fit (95%)':>25} "
          f"{'speed / expframe (95%)':>25}")
    for name in names:
        entry = {"images_per_sec": row[name]["images_per_sec"], "median_s_per_call": row[name]["median_s_per_call"],
                 "times_s": times[name]}
        cells = []
        for other in ("keras_fit", "expframe"):
            if other in times and other != name:
                s = spread.of([o / m for m, o in zip(times[name], times[other], strict=True)])
                entry[f"over_{other}"] = s
                cells.append(f"{s['median']:>9.3f} ({s['low']:.3f}-{s['high']:.3f})")
            else:
                cells.append(f"{'-':>25}")
        out["variants"][name] = entry
        print(f"{name:>13} | {entry['images_per_sec']:>8.2f} {entry['median_s_per_call']:>7.3f} | "
              f"{cells[0]:>25} {cells[1]:>25}", flush=True)
    out["wall_s"] = time.perf_counter() - started
    path = args.out or os.path.join(RESULTS, f"fit_gap_{args.size}px_{args.replicas}rep_{args.precision}.json")
    write_result(path, out)
    print(f"1-minute load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{out['wall_s']:.0f} s", flush=True)
    del row
    gc.collect()


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
