"""ResNet-50 training throughput: expframe's Trainer vs a hand-written loop vs Keras fit.

    python benchmarks/resnet50_throughput.py            # 8 configurations x 3 runners
    python benchmarks/resnet50_throughput.py --quick    # 2 configurations, batch 4, 1 step per call

For each image size (224 and a smaller one), replica count (1 and 2 logical CPU
devices) and precision (float32, mixed_bfloat16) it builds the same ResNet-50 v1.5
(`expframe.models.resnet.resnet(depth=50)`, Keras BatchNormalization, 1000 classes)
three times, fresh under each Keras precision policy, on the same strategy (the
Replicator's; `--baseline_strategy tf_default` gives the baselines TensorFlow's
default MirroredStrategy instead), and trains it on one synthetic in-memory batch
(`from_tensors(batch).repeat()`) with SGD + momentum:

  expframe     `ClassificationTask` + `Replicator('cpu', n)` + `Trainer`, timing one
               `trainer.run_train_steps(k)` host call (k steps in one tf.function).
  handwritten  one tf.function running `strategy.run(step)` k times in `tf.range`;
               gradients / replicas into the plain Keras optimizer (which sums over
               replicas); benchmarks/handwritten.py.
  keras_fit    `model.compile(..., steps_per_execution=k)` in the strategy's scope,
               timing `model.fit(dataset, epochs=1, steps_per_epoch=k)` calls (so each
               call includes fit's own per-call set-up: iterator, callbacks).

The three are timed interleaved (one call each, in rotating order), each as fit times
itself: the second of two calls in a row (`timed_call`). Each ratio is
paired, expframe's speed over the other's (call i of the other's seconds / call i of
expframe's), and reported with its spread over the repeats (each row's `spread`:
minimum, median, maximum and a 95 % bootstrap interval of the median,
expframe/reproduce/spread.py), as is expframe's MFU; `--repeats` defaults to 30, enough
for a ratio's interval of +-5 % (3 for --quick, whose figures are not for quoting).
It also measures the machine's peak matmul rate (a square tf.matmul, float32 and
bfloat16, 2 n^3 FLOPs per product) and reports model FLOPs utilisation as MLPerf and
the scaling literature count it, 2 FLOPs per multiply-add:

    MFU = 3 x 2 x 4.1 G x (size / 224)^2 x images/s / peak matmul FLOP/s

ResNet-50's forward pass at 224x224 is about 4.1 G multiply-adds per image (8.2
GFLOP); training is 3x the forward pass (forward + backward), 24.6 GFLOP per image
at 224; convolution FLOPs scale with the pixel count, (size / 224)^2.

Precision `auto` (in --precisions) stands for the policy `run_experiment.precision = 'auto'` picks
on this machine, measured once if it is another listed.

Cost: each configuration builds and traces three ResNet-50s, about a minute each on
2 cores, then times them: a repeat at 224x224 with batch 4 and one step per call is
about 5.4 s (two calls of 0.9 s each for expframe and hand-written, fit's two
executions 1.8), 1.8 s at 128 (`--quick`'s 2 configurations, 224 and 128 on 2
replicas, float32, 3 repeats, took 6.5 minutes; the default runs 8 configurations at
batch 8). The benchmarks set runs the page's setting (batch 4, one step per call) at
224 and 128 px on 2 and 1 replicas, float32 and 'auto', with 30 repeats: about 30
minutes (expframe/reproduce/registry.py). Narrow it with --sizes, --replicas,
--precisions, --runners.

Profile (`--profile_dir DIR`): after each configuration's timed repeats, one more host
call of each runner (`--profile_calls N`: N more) runs under the TensorFlow profiler,
into DIR/<size>px_<n>rep_<precision>_<runner>/, to see where a call's time goes:
`python benchmarks/profile_breakdown.py DIR --calls N` prints it by op kind per runner
(or open DIR with `tensorboard --logdir DIR`, Profile tab: the `profile` extra); those
calls are not among the timed ones.

Precision 'auto': the report marks with * the precision that `run_experiment.precision
= 'auto'` runs with on this machine (its cached measurement, or one made at the start:
expframe/replicator/auto_settings.py) and, for every size and replica count measured
at both float32 and mixed_bfloat16, says whether that was the faster one for ResNet-50.

Results: a table on stdout and JSON in `benchmarks/results/resnet50_throughput.json`.
"""

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from typing import NamedTuple, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import expframe  # noqa: E402  (sets the CPU allocator before TensorFlow starts)

try:
    expframe.split_cpu(2)  # before any TensorFlow op: 2 logical CPU devices
except expframe.ConfigError:
    pass  # split already, into fewer: own_process.py's one-replica workers split as main.py does

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import handwritten  # noqa: E402  (benchmarks/handwritten.py)
from expframe.models.resnet import resnet  # noqa: E402
from expframe.replicator import auto_settings, autotune  # noqa: E402
from expframe.reproduce import spread  # noqa: E402
from expframe.tasks.classification import ClassificationTask  # noqa: E402
from expframe.trainer import Trainer  # noqa: E402
from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

FORWARD_GMAC_224 = 4.1  # ResNet-50 forward pass at 224x224: G multiply-adds per image
FLOPS_PER_MAC = 2       # one multiply + one add, as MLPerf and the matmul peak count them
TRAIN_OVER_FORWARD = 3  # forward + backward (gradients of activations and of weights)
NUM_CLASSES = 1000
LEARNING_RATE, MOMENTUM = 0.1, 0.9
RUNNERS = ("expframe", "handwritten", "keras_fit")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "resnet50_throughput.json")


# -- the machine ------------------------------------------------------------------------

def peak_matmul_gflops(n: int, repeats: int) -> dict:
    """Median GFLOP/s (2 n^3 per product) of an n x n tf.matmul, float32 and bfloat16."""
    out = {}
    for dtype in (tf.float32, tf.bfloat16):
        a = tf.cast(tf.random.stateless_normal((n, n), seed=(1, 2)), dtype)
        b = tf.cast(tf.random.stateless_normal((n, n), seed=(3, 4)), dtype)
        product = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[0, :1], tf.float32)))
        product(a, b).numpy()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product(a, b).numpy()
            times.append(time.perf_counter() - start)
        out[dtype.name] = 2 * n ** 3 / statistics.median(times) / 1e9
    return out


# -- the three ways to train ------------------------------------------------------------

class Setup(NamedTuple):
    """One configuration: where, what size, which precision, XLA or not."""

    size: int
    num_replicas: int
    precision: str
    global_batch: int
    steps: int
    strategy_kind: str = "same"     # the baselines' strategy (benchmarks/handwritten.py)
    target: str = "cpu"             # 'cpu' or 'gpu'
    jit_compile: bool = False       # XLA for all three (Keras fit: its `jit_compile`)
    depth: int = 50                 # ResNet depth (gpu_check's CPU test uses a small one)
    fit_strategy_kind: Optional[str] = None  # Keras fit's strategy (default: strategy_kind)


def synthetic_batch(batch_size: int, size: int):
    rng = np.random.default_rng(0)
    return {"image": rng.standard_normal((batch_size, size, size, 3)).astype(np.float32),
            "label": rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)}


def build_model(size: int, depth: int = 50) -> keras.Model:
    keras.utils.set_random_seed(0)
    return resnet(depth=depth, num_classes=NUM_CLASSES, input_shape=(size, size, 3))


def build_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)


class ExpframeRunner:
    """The Trainer's host call, prepared as run_experiment prepares it."""

    def __init__(self, cfg: Setup):
        def dataset(split, ctx, batch_size, training, seed, deterministic):
            del split, ctx, training, seed, deterministic
            return tf.data.Dataset.from_tensors(synthetic_batch(batch_size, cfg.size)).repeat()

        task = ClassificationTask(model=lambda: build_model(cfg.size, cfg.depth), dataset=dataset,
                                  optimizer=build_optimizer, eval_split=None)
        self.trainer = Trainer(train_steps=10 ** 9, global_batch_size=cfg.global_batch, steps_per_loop=cfg.steps)
        replicator = expframe.Replicator(cfg.target, cfg.num_replicas, jit_compile=cfg.jit_compile)
        self.trainer.prepare(replicator, task, seed=0, deterministic=False)
        self.steps = cfg.steps

    def __call__(self):
        t, start = self.trainer, time.perf_counter()
        loss = t.run_train_steps(self.steps)["loss"]
        return loss, time.perf_counter() - start


class HandwrittenRunner:
    """A minimal custom training loop over `strategy.run` (benchmarks/handwritten.py)."""

    def __init__(self, cfg: Setup):
        strategy = handwritten.baseline_strategy(cfg.strategy_kind, cfg.num_replicas, cfg.target)
        with strategy.scope():
            model, optimizer = build_model(cfg.size, cfg.depth), build_optimizer()
        self._call = handwritten.handwritten_loop(
            strategy, model, optimizer,
            lambda per_replica: tf.data.Dataset.from_tensors(synthetic_batch(per_replica, cfg.size)).repeat(),
            cfg.global_batch, NUM_CLASSES, jit_compile=cfg.jit_compile)
        self.steps = cfg.steps

    def __call__(self):
        start = time.perf_counter()
        loss = self._call(self.steps)
        return loss, time.perf_counter() - start


class KerasFitRunner:
    """`model.fit` with the same strategy, model, batch and optimizer; `jit_compile` as
    configured (`keras_default_jit` records what Keras' own default, 'auto', picks)."""

    times_second_of_two = True  # a call runs two executions and times the second (timed_call)

    def __init__(self, cfg: Setup):
        strategy = handwritten.baseline_strategy(cfg.fit_strategy_kind or cfg.strategy_kind, cfg.num_replicas,
                                                 cfg.target)
        with strategy.scope():
            self.model = build_model(cfg.size, cfg.depth)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.model.compile(optimizer=build_optimizer(), loss=loss, steps_per_execution=cfg.steps,
                               jit_compile="auto")
            self.keras_default_jit = bool(self.model.jit_compile)
            self.model.compile(optimizer=build_optimizer(), loss=loss, steps_per_execution=cfg.steps,
                               jit_compile=cfg.jit_compile)
        batch = synthetic_batch(cfg.global_batch, cfg.size)  # fit wants (x, y), not a dict
        self.dataset = tf.data.Dataset.from_tensors((batch["image"], batch["label"])).repeat()
        self.steps = cfg.steps

    def __call__(self):
        """Steady state: fit runs 2 executions of k steps; timed is the second, from the
        end of the first to the end of the second (fit's per-call set-up excluded)."""
        clock = _ExecutionClock()
        start = time.perf_counter()
        history = self.model.fit(self.dataset, epochs=1, steps_per_epoch=2 * self.steps, verbose=0,
                                 callbacks=[clock])
        self.last_call_s = time.perf_counter() - start
        return float(history.history["loss"][-1]), clock.ends[-1] - clock.ends[-2]


class _ExecutionClock(keras.callbacks.Callback):
    """Times the ends of fit's executions (one per steps_per_execution steps)."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def timed_call(runner) -> tuple:
    """(loss, seconds) of one host call of `runner`, timed as fit times itself: the second
    of two calls in a row. fit's timed execution follows its first at once, caches and
    threads warm; a runner timed on a lone call follows another runner's calls instead
    (issue 61: that alone read expframe / fit 0.951 at 128 px where timed alike it was
    0.992, benchmarks/own_process.py). So every runner that does not time the second of
    its own executions (`times_second_of_two`) makes one untimed call first."""
    if not getattr(runner, "times_second_of_two", False):
        runner()
    return runner()


RUNNER_CLASSES = {"expframe": ExpframeRunner, "handwritten": HandwrittenRunner, "keras_fit": KerasFitRunner}


def measure(cfg: Setup, repeats: int, runners: Sequence[str] = RUNNERS, profile_dir: Optional[str] = None,
            profile_calls: int = 1) -> dict:
    """Images/s of the runners on one configuration, timed interleaved. With `profile_dir`,
    `profile_calls` more host calls of each runner after the timed ones are traced by the
    TensorFlow profiler into `<profile_dir>/<size>px_<n>rep_<precision>_<runner>/`
    (TensorBoard's Profile tab, or benchmarks/profile_breakdown.py: where a call's time
    goes), their seconds recorded as `profiled_call_s`."""
    keras.mixed_precision.set_global_policy(cfg.precision)
    try:
        built, build_s, first_s = {}, {}, {}
        for name in runners:
            start = time.perf_counter()
            built[name] = RUNNER_CLASSES[name](cfg)
            build_s[name] = time.perf_counter() - start
            start = time.perf_counter()
            built[name]()  # trace + first steps, not timed
            first_s[name] = time.perf_counter() - start
        for name in runners:  # the second call of a fresh function was seen to take 10x longer
            built[name]()
        times = {name: [] for name in runners}
        for i in range(repeats):
            order = list(runners[i % len(runners):]) + list(runners[:i % len(runners)])  # rotate who goes first
            for name in order:
                loss, seconds = timed_call(built[name])
                times[name].append(seconds)
                if not np.isfinite(loss):
                    raise RuntimeError(f"{name}: loss {loss} at {cfg}")
        profiled = {name: _profiled_call(built[name], os.path.join(
            profile_dir, f"{cfg.size}px_{cfg.num_replicas}rep_{cfg.precision}_{name}"), profile_calls)
            for name in runners} if profile_dir else {}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    row = {"image_size": cfg.size, "num_replicas": cfg.num_replicas, "precision": cfg.precision,
           "global_batch_size": cfg.global_batch, "steps_per_call": cfg.steps, "repeats": repeats,
           "target": cfg.target, "jit_compile": cfg.jit_compile, "depth": cfg.depth}
    for name in runners:
        median = statistics.median(times[name])
        row[name] = {"images_per_sec": cfg.steps * cfg.global_batch / median, "median_s_per_call": median,
                     "times_s": times[name], "build_s": build_s[name], "first_call_s": first_s[name]}
        if name in profiled:
            row[name]["profiled_call_s"], row[name]["profile"] = profiled[name]
    if "keras_fit" in built:
        row["keras_fit"]["keras_default_jit_compile"] = built["keras_fit"].keras_default_jit
    row["spread"] = {}
    for name in ("handwritten", "keras_fit"):
        if "expframe" in runners and name in runners:
            row[f"expframe_over_{name}"] = row["expframe"]["images_per_sec"] / row[name]["images_per_sec"]
            # Paired per-repeat ratios are steadier on a shared machine.
            paired = [o / e for e, o in zip(times["expframe"], times[name], strict=True)]
            row[f"expframe_over_{name}_paired"] = statistics.median(paired)
            row["spread"][f"expframe_over_{name}"] = spread.of(paired)
    del built
    gc.collect()
    return row


def _profiled_call(runner, logdir: str, calls: int = 1) -> tuple[list, str]:
    """`calls` host calls of `runner` under the TensorFlow profiler (not timed with the
    others): their seconds, and the folder."""
    tf.profiler.experimental.start(logdir)
    try:
        seconds = [runner()[1] for _ in range(calls)]
    finally:
        tf.profiler.experimental.stop()
    return seconds, logdir


def _paired(row: dict, other: str) -> str:
    """`0.974 (0.951-1.003)`: the paired ratio against `other` and its interval, or '-'."""
    found = row.get("spread", {}).get(f"expframe_over_{other}")
    return f"{found['median']:>7.3f} ({found['low']:.3f}-{found['high']:.3f})" if found else f"{'-':>22}"


def train_gflop_per_image(size: int) -> float:
    """FLOPs of one training step per image, in G: 3 x 2 x 4.1 G x (size / 224)^2 (24.6 at 224)."""
    return TRAIN_OVER_FORWARD * FLOPS_PER_MAC * FORWARD_GMAC_224 * (size / 224) ** 2


def mfu(images_per_sec: float, size: int, peak_gflops: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second over the peak matmul FLOPs per second."""
    return train_gflop_per_image(size) * images_per_sec / peak_gflops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 configurations, batch 4, 1 step per call (~12 minutes on 2 cores)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--replicas", type=int, nargs="+", default=None)
    parser.add_argument("--precisions", nargs="+", default=None,
                        help="Keras precision policies, or 'auto': the one run_experiment.precision='auto' picks here")
    parser.add_argument("--global_batch_size", type=int, default=None)
    parser.add_argument("--steps_per_call", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"interleaved repeats (default {spread.REPEATS}: a ratio's interval within +-5 %%; "
                             "3 for --quick)")
    parser.add_argument("--baseline_strategy", choices=handwritten.STRATEGIES, default="same",
                        help="the baselines' MirroredStrategy (see benchmarks/handwritten.py)")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS),
                        help="which of the three to time (default all)")
    parser.add_argument("--profile_dir", default=None,
                        help="also trace one more host call of each runner per configuration with the TensorFlow "
                             "profiler, into DIR/<size>px_<n>rep_<precision>_<runner>/ (tensorboard --logdir DIR, "
                             "or benchmarks/profile_breakdown.py DIR)")
    parser.add_argument("--profile_calls", type=int, default=1,
                        help="host calls per runner in each profile (default 1); profile_breakdown.py --calls "
                             "divides by it")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        defaults = dict(sizes=[224, 128], replicas=[2], precisions=["float32"], global_batch_size=4,
                        steps_per_call=1, repeats=3, matmul_n=1024)
    else:
        defaults = dict(sizes=[224, 128], replicas=[1, 2], precisions=["float32", "mixed_bfloat16"],
                        global_batch_size=8, steps_per_call=2, repeats=spread.REPEATS, matmul_n=2048)
    cfg = {k: (getattr(args, k, None) or v) for k, v in defaults.items()}

    started = time.perf_counter()
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; MFU counts {train_gflop_per_image(224):.1f} GFLOP per "
          f"224x224 training image (3 x 2 x {FORWARD_GMAC_224} G multiply-adds)", flush=True)
    peak = peak_matmul_gflops(cfg["matmul_n"], repeats=5)
    print(f"peak matmul ({cfg['matmul_n']}^2): float32 {peak['float32']:.1f} GFLOP/s, "
          f"bfloat16 {peak['bfloat16']:.1f} GFLOP/s", flush=True)
    # What `run_experiment.precision = 'auto'` runs with on this machine (its cached
    # measurement, or one made now), set beside the precisions measured below.
    auto = auto_settings.precision_choice("cpu")
    # 'auto': the precision `run_experiment.precision = 'auto'` runs with here (once, if it is another one listed).
    cfg["precisions"] = list(dict.fromkeys(auto.value if p == "auto" else p for p in cfg["precisions"]))
    load_start = os.getloadavg()[0]
    print(f"ResNet-50, global batch {cfg['global_batch_size']}, {cfg['steps_per_call']} step(s) per call, "
          f"{cfg['repeats']} interleaved repeats; images/s (MFU); * = the precision 'auto' chose here")
    print(f"{'size':>4} {'rep':>3} {'precision':>14} | {'expframe':>14} {'handwritten':>14} {'keras_fit':>14} "
          f"| {'xf/hand (95% interval)':>22} {'xf/fit (95% interval)':>22}")
    rows = []
    for size in cfg["sizes"]:
        for n in cfg["replicas"]:
            for precision in cfg["precisions"]:
                row = measure(Setup(size, n, precision, cfg["global_batch_size"], cfg["steps_per_call"],
                                    args.baseline_strategy), cfg["repeats"], tuple(args.runners), args.profile_dir,
                              args.profile_calls)
                peak_for = peak["bfloat16" if "bfloat16" in precision else "float32"]
                for name in args.runners:
                    row[name]["mfu"] = mfu(row[name]["images_per_sec"], size, peak_for)
                if "expframe" in args.runners:  # its MFU call by call
                    row["spread"]["expframe_mfu"] = spread.of(
                        [mfu(row["steps_per_call"] * row["global_batch_size"] / t, size, peak_for)
                         for t in row["expframe"]["times_s"]])
                row["peak_gflops_used"] = peak_for
                rows.append(row)
                cells = " ".join(f"{row[r]['images_per_sec']:>7.2f} ({row[r]['mfu']:>4.0%})" if r in row
                                 else f"{'-':>14}" for r in RUNNERS)
                mark = "*" if precision == auto.value else " "
                print(f"{size:>4} {n:>3} {mark}{precision:>13} | {cells} | "
                      f"{_paired(row, 'handwritten')} {_paired(row, 'keras_fit')}", flush=True)
                # After every configuration: a long run stopped early keeps what it measured.
                result = {"benchmark": "resnet50_throughput", "quick": args.quick, "config": cfg,
                          "baseline_strategy": args.baseline_strategy,
                          "peak_matmul_gflops": peak, "forward_gmac_per_image_224": FORWARD_GMAC_224,
                          "flops_per_mac": FLOPS_PER_MAC, "train_gflop_per_image_224": train_gflop_per_image(224),
                          "tensorflow": tf.__version__, "keras": keras.__version__,
                          "machine": {"platform": platform.platform(), "cpu": cpu_name(), "cpus": os.cpu_count()},
                          "auto_precision": auto_report(auto, rows),
                          "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
                          "wall_s": time.perf_counter() - started, "results": rows}
                write_result(args.out, result, say=False)
    for line in auto_report(auto, rows)["lines"]:
        print(line)
    print(f"1-minute load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end "
          f"({os.cpu_count()} CPUs; ratios are measured side by side)")
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")


def auto_report(auto, rows) -> dict:
    """'auto''s choice and its probe beside what this run measured: for each size and
    replica count with both float32 and mixed_bfloat16, expframe's mixed_bfloat16 /
    float32 images/s, and whether 'auto' picked the faster one."""
    probe = autotune.ratios_text(auto.seconds, ("float32", "mixed_bfloat16")) if auto.seconds else "not measured"
    report = {"choice": auto.value, "probe_seconds": auto.seconds, "measured_at": auto.measured_at,
              "probe_load_average": auto.load_average, "cache": auto.path, "comparisons": [],
              "lines": [f"precision 'auto' on this machine: {auto.value} (its probe: {probe}, measured "
                        f"{'now' if auto.measured_now else auto.measured_at})"]}
    by_config = {}
    for row in rows:
        by_config.setdefault((row["image_size"], row["num_replicas"]), {})[row["precision"]] = row
    for (size, n), found in sorted(by_config.items()):
        if {"float32", "mixed_bfloat16"} <= found.keys():
            speed = {p: found[p]["expframe"]["images_per_sec"] for p in ("float32", "mixed_bfloat16")}
            ratio = speed["mixed_bfloat16"] / speed["float32"]
            faster = "mixed_bfloat16" if ratio > 1 else "float32"
            report["comparisons"].append({"image_size": size, "num_replicas": n, "bfloat16_over_float32": ratio,
                                          "auto_picked_the_faster": faster == auto.value})
            report["lines"].append(
                f"  ResNet-50 {size}x{size}, {n} replica(s): mixed_bfloat16 {ratio:.2f}x float32 (expframe); "
                f"'auto' {'picked' if faster == auto.value else 'did NOT pick'} the faster ({faster})")
    return report

if __name__ == "__main__":
    main()
