"""What expframe's train loop costs over a minimal hand-written tf.distribute loop.

    python benchmarks/runner_overhead.py            # ~20 minutes on 2 idle cores (30 repeats)
    python benchmarks/runner_overhead.py --quick    # ~1 minute

The same model (CIFAR ResNet-20, 10 classes, 32x32, Keras BatchNormalization), the
same synthetic in-memory batch (`tf.data.Dataset.from_tensors(batch).repeat()`: no
disk, no preprocessing), the same global batch, the same optimizer (SGD, momentum
0.9) and loss (softmax cross-entropy, mean per replica), trained two ways on the
same logical CPU devices:

  expframe     `ClassificationTask` + `Replicator('cpu', n)` + `Trainer`, prepared as
               `main.py` does, timing `trainer.run_train_steps(steps_per_loop)`, which
               reads its metrics back (what `Trainer.train` does per host call, minus
               logging and checkpoints).
  handwritten  the tf.distribute guide's minimal custom loop (benchmarks/handwritten.py)
               on the Replicator's strategy (`--baseline_strategy tf_default`: on
               `MirroredStrategy(devices)` with TensorFlow's defaults).

The two are timed interleaved (one host call each, alternately) on 1 and 2 replicas.
The figure is the paired ratio, expframe's speed over the loop's (call i of the loop's
seconds / call i of expframe's), over `--repeats` repeats (default 30: enough for a
95 % interval of +-5 %, expframe/reproduce/spread.py): its median, minimum, maximum and
bootstrap interval (each result row's `spread`). Parity when the interval holds 1.00;
a regression when all of it is below 0.97 (issue 3's goal).
Results: a table on stdout and JSON in `benchmarks/results/runner_overhead.json`.
"""

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import expframe  # noqa: E402  (sets the CPU allocator before TensorFlow starts)

expframe.split_cpu(2)  # before any TensorFlow op: 2 logical CPU devices

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import handwritten  # noqa: E402  (benchmarks/handwritten.py)
from expframe.models.resnet import resnet  # noqa: E402
from expframe.reproduce import spread  # noqa: E402
from expframe.tasks.classification import ClassificationTask  # noqa: E402
from expframe.trainer import Trainer  # noqa: E402
from machine import write_result  # noqa: E402  (benchmarks/machine.py)

GOAL = 0.97
NUM_CLASSES, IMAGE_SHAPE = 10, (32, 32, 3)
LEARNING_RATE, MOMENTUM = 0.1, 0.9
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "runner_overhead.json")


def synthetic_batch(batch_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((batch_size,) + IMAGE_SHAPE).astype(np.float32),
            "label": rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)}


def synthetic_dataset(batch_size: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensors(synthetic_batch(batch_size)).repeat()


def build_model() -> keras.Model:
    return resnet(depth=20, num_classes=NUM_CLASSES, input_shape=IMAGE_SHAPE)


def build_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)


class ExpframeRunner:
    """The Trainer's host call, set up exactly as run_experiment sets it up."""

    name = "expframe"

    def __init__(self, num_replicas: int, global_batch: int):
        def dataset(split, ctx, batch_size, training, seed, deterministic):
            del split, ctx, training, seed, deterministic
            return synthetic_dataset(batch_size)

        replicator = expframe.Replicator("cpu", num_replicas)
        task = ClassificationTask(model=build_model, dataset=dataset, optimizer=build_optimizer,
                                  eval_split=None)
        keras.utils.set_random_seed(0)
        self.trainer = Trainer(train_steps=10 ** 9, global_batch_size=global_batch)
        self.trainer.prepare(replicator, task, seed=0, deterministic=False)

    def call(self, steps: int) -> float:
        return self.trainer.run_train_steps(steps)["loss"]  # the host call of Trainer.train


class HandwrittenRunner:
    """The minimal custom training loop of the tf.distribute guide (benchmarks/handwritten.py)."""

    name = "handwritten"

    def __init__(self, num_replicas: int, global_batch: int, strategy_kind: str):
        strategy = handwritten.baseline_strategy(strategy_kind, num_replicas)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model, optimizer = build_model(), build_optimizer()
        self.call = handwritten.handwritten_loop(strategy, model, optimizer, synthetic_dataset, global_batch,
                                                 NUM_CLASSES)


def measure(num_replicas: int, global_batch: int, steps: int, repeats: int, strategy_kind: str) -> dict:
    runners = [ExpframeRunner(num_replicas, global_batch), HandwrittenRunner(num_replicas, global_batch, strategy_kind)]
    first_loss = {}
    for r in runners:  # trace and warm up (not timed)
        first_loss[r.name] = r.call(steps)
        r.call(steps)
    times = {r.name: [] for r in runners}
    for i in range(repeats):
        order = runners if i % 2 == 0 else runners[::-1]  # neither always goes first
        for r in order:
            start = time.perf_counter()
            r.call(steps)
            times[r.name].append(time.perf_counter() - start)
    out = {"num_replicas": num_replicas, "global_batch_size": global_batch, "steps_per_call": steps,
           "repeats": repeats, "first_call_loss": first_loss}
    for name, ts in times.items():
        out[name] = {"median_s_per_call": statistics.median(ts), "min_s_per_call": min(ts),
                     "examples_per_sec": steps * global_batch / statistics.median(ts), "times_s": ts}
    # Paired ratios (call i of one against call i of the other) are less noisy on a
    # shared machine than the ratio of medians; report both.
    paired = [h / e for e, h in zip(times["expframe"], times["handwritten"], strict=True)]
    out["ratio_of_medians"] = out["expframe"]["examples_per_sec"] / out["handwritten"]["examples_per_sec"]
    out["median_paired_ratio"] = statistics.median(paired)
    out["spread"] = {"expframe_over_handwritten": spread.of(paired)}
    return out


def _interval(row: dict) -> str:
    found = row["spread"]["expframe_over_handwritten"]
    return f"{found['low']:.3f}-{found['high']:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (~1 minute)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--global_batch_size", type=int, default=128)
    parser.add_argument("--steps_per_call", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--baseline_strategy", choices=handwritten.STRATEGIES, default="same")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    steps = args.steps_per_call or (5 if args.quick else 20)
    repeats = args.repeats or (5 if args.quick else spread.REPEATS)

    rows = []
    print(f"ResNet-20 (CIFAR), global batch {args.global_batch_size}, {steps} steps per call, "
          f"{repeats} interleaved repeats; goal expframe/handwritten >= {GOAL}")
    print(f"{'replicas':>8} {'expframe ex/s':>14} {'handwritten ex/s':>17} {'ratio':>7} {'paired':>7} "
          f"{'95% interval':>15}  verdict")
    for n in args.replicas:
        row = measure(n, args.global_batch_size, steps, repeats, args.baseline_strategy)
        rows.append(row)
        print(f"{n:>8} {row['expframe']['examples_per_sec']:>14.1f} {row['handwritten']['examples_per_sec']:>17.1f} "
              f"{row['ratio_of_medians']:>7.3f} {row['median_paired_ratio']:>7.3f} {_interval(row):>15}  "
              f"{spread.verdict(row['spread']['expframe_over_handwritten'], spread.parity(GOAL))}", flush=True)
    result = {"benchmark": "runner_overhead", "model": "resnet20_cifar", "goal_ratio": GOAL,
              "baseline_strategy": args.baseline_strategy,
              "quick": args.quick, "tensorflow": tf.__version__, "keras": keras.__version__,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "results": rows,
              "meets_goal": all(r["median_paired_ratio"] >= GOAL for r in rows),
              "regression": any(spread.regression(r["spread"]["expframe_over_handwritten"], spread.parity(GOAL))
                                for r in rows)}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
