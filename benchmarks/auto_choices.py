"""The measurements behind 'auto' on this machine's CPU: precision and XLA.

    python benchmarks/auto_choices.py            # about 1.5 minutes on 2 idle cores
    python benchmarks/auto_choices.py --quick    # about 40 s: fewer timings

Two questions, each answered side by side in one process (candidates interleaved,
the fastest of `--repeats` timings counting, as `expframe/replicator/autotune.py`
does; other work on the machine only ever adds time):

  precision  bfloat16 against float32: the probe that `run_experiment.precision =
             'auto'` times (`probes.precision_timer`: a chain of matmuls and 3x3
             convolutions), then the same sizes with matmuls only and convolutions
             only, so that a verdict can be traced to the op. The speed ratio is
             float32 seconds / bfloat16 seconds (above 1: bfloat16 is faster), and
             the choice the rule (`autotune.decide`: at least 5% faster) makes.
  xla        XLA against TensorFlow's default kernels on 1 CPU replica: the XLA probe
             (`probes.xla_timer`, a small convnet's training step; what 'auto' would
             time on a GPU), and the quickstart's model (ResNet-8, SyncBatchNorm,
             32x32, batch 120, Adam) trained through expframe, `Replicator('cpu', 1,
             jit_compile=False)` against `jit_compile=True`, timing
             `Trainer.run_train_steps` host calls. Ratio: XLA's speed / the default's.

It measures afresh and never reads or writes the cache of measured choices. The load
average is recorded at start and end: run it on a quiet machine. Results: a table on
stdout and JSON in benchmarks/results/auto_choices.json.
"""

import argparse
import os
import sys
import time
from typing import Callable, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import expframe  # noqa: E402  (sets the CPU allocator before TensorFlow starts)

# isort: split
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from expframe import provenance  # noqa: E402
from expframe.layers import SyncBatchNorm  # noqa: E402
from expframe.models.resnet import resnet  # noqa: E402
from expframe.replicator import autotune, probes  # noqa: E402
from expframe.tasks.classification import ClassificationTask  # noqa: E402
from expframe.trainer import Trainer  # noqa: E402
from machine import write_result  # noqa: E402  (benchmarks/machine.py)

RESULTS = os.path.join(_HERE, "results", "auto_choices.json")
DEVICE = "/device:CPU:0"
QUICKSTART_BATCH = 120
# The CPU probe's sizes (probes._PRECISION_SIZES["CPU"]): matmul n, conv batch, spatial size, channels, chain.
N, CONV_BATCH, CONV_SIZE, CHANNELS, CHAIN = 384, 4, 24, 64, 3


def fastest(timer: Callable[[str], float], candidates, repeats: int) -> Dict[str, float]:
    """Each candidate's fastest of `repeats` interleaved timings (`autotune.measure`)."""
    return autotune.measure(candidates, timer, repeats)


def op_timer(kind: str) -> Callable[[str], float]:
    """Times the precision probe's matmuls alone ("matmul") or its convolutions alone
    ("conv"), in float32 or bfloat16, at the probe's CPU sizes."""
    with tf.device(DEVICE):
        a32 = tf.random.stateless_normal((N, N), seed=(1, 2))
        b32 = tf.random.stateless_normal((N, N), seed=(3, 4)) / N ** 0.5
        x32 = tf.random.stateless_normal((CONV_BATCH, CONV_SIZE, CONV_SIZE, CHANNELS), seed=(5, 6))
        w32 = tf.random.stateless_normal((3, 3, CHANNELS, CHANNELS), seed=(7, 8)) / (9 * CHANNELS) ** 0.5

    @tf.function(reduce_retracing=True)
    def chain(a, b):
        for _ in range(CHAIN):
            a = tf.matmul(a, b) if kind == "matmul" else tf.nn.conv2d(a, b, strides=1, padding="SAME")
        return tf.cast(tf.reshape(a, [-1])[0], tf.float32)

    operands = (a32, b32) if kind == "matmul" else (x32, w32)
    runs = {policy: (lambda dtype=probes.COMPUTE_DTYPES[policy]: chain(*(tf.cast(t, dtype) for t in operands)))
            for policy in ("float32", "mixed_bfloat16")}
    warm = set()

    def timer(policy: str) -> float:
        if policy not in warm:
            runs[policy]().numpy()
            warm.add(policy)
        start = time.perf_counter()
        runs[policy]().numpy()
        return time.perf_counter() - start
    return timer


def quickstart_timer(steps_per_call: int) -> Callable[[str], float]:
    """Times `run_train_steps(steps_per_call)` of the quickstart's model through expframe
    on 1 CPU replica, "off" (jit_compile=False) and "on" (jit_compile=True)."""
    rng = np.random.default_rng(0)
    batch = {"image": rng.standard_normal((QUICKSTART_BATCH, 32, 32, 3)).astype(np.float32),
             "label": rng.integers(0, 10, QUICKSTART_BATCH).astype(np.int32)}

    def model():
        keras.utils.set_random_seed(0)
        return resnet(depth=8, num_classes=10, input_shape=(32, 32, 3), norm=SyncBatchNorm, stem_stride=2)

    trainers = {}
    for name, jit in (("off", False), ("on", True)):
        task = ClassificationTask(
            model=model, optimizer=lambda: keras.optimizers.Adam(2e-3), eval_split=None,
            dataset=lambda split, ctx, batch_size, **_: tf.data.Dataset.from_tensors(
                {k: v[:batch_size] for k, v in batch.items()}).repeat())
        trainer = Trainer(train_steps=10 ** 9, global_batch_size=QUICKSTART_BATCH)
        replicator = expframe.Replicator("cpu", 1, jit_compile=jit)
        trainer.prepare(replicator, task, seed=0, deterministic=False)
        assert replicator.compiles_steps is jit
        trainers[name] = trainer
    warm = set()

    def timer(name: str) -> float:
        if name not in warm:  # trace (and compile) untimed
            trainers[name].run_train_steps(steps_per_call)
            warm.add(name)
        start = time.perf_counter()
        loss = trainers[name].run_train_steps(steps_per_call)["loss"]
        seconds = time.perf_counter() - start
        if not np.isfinite(loss):
            raise RuntimeError(f"quickstart loss {loss} with XLA {name}")
        return seconds
    return timer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timings (about 40 s)")
    parser.add_argument("--repeats", type=int, default=None, help="timings per candidate (default 9; quick 5)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    steps_per_call = 3 if args.quick else 5
    load_start, started = os.getloadavg()[0], time.time()
    model = probes.device_model(DEVICE)
    print(f"{model}, {os.cpu_count()} CPUs, TensorFlow {tf.__version__}; fastest of {repeats} interleaved "
          f"timings each; load average {load_start:.2f}", flush=True)
    precision = ("float32", "mixed_bfloat16")
    rows = []

    def report(question, what, candidates, seconds, note=""):
        ratio = seconds[candidates[0]] / seconds[candidates[1]]
        row = {"question": question, "probe": what, "seconds": seconds, "ratio": ratio,
               "rule_picks": autotune.decide(seconds, candidates), "note": note}
        rows.append(row)
        print(f"  {question:>9} | {what:<46} | {candidates[1]} {ratio:.2f}x {candidates[0]} | "
              f"rule picks {row['rule_picks']}{'; ' + note if note else ''}", flush=True)

    report("precision", "'auto''s probe: matmul + conv chain", precision,
           fastest(probes.precision_timer(DEVICE), precision, repeats))
    report("precision", f"matmul only ({N}x{N}, chain {CHAIN})", precision,
           fastest(op_timer("matmul"), precision, repeats))
    report("precision", f"3x3 conv only ({CONV_BATCH}x{CONV_SIZE}x{CONV_SIZE}x{CHANNELS})", precision,
           fastest(op_timer("conv"), precision, repeats))
    xla = ("off", "on")
    report("xla", "XLA probe: small convnet train step", xla, fastest(probes.xla_timer(DEVICE), xla, repeats),
           "('auto' measures this on GPUs only)")
    report("xla", f"quickstart through expframe, {steps_per_call} steps/call", xla,
           fastest(quickstart_timer(steps_per_call), xla, repeats),
           f"{QUICKSTART_BATCH} examples/step; Replicator.jit_compile True vs False")
    load_end = os.getloadavg()[0]
    print(f"1-minute load average {load_start:.2f} at start, {load_end:.2f} at end; {time.time() - started:.0f} s")
    result = {"benchmark": "auto_choices", "device": model, "tensorflow": tf.__version__, "repeats": repeats,
              "rows": rows, "load_average_1min": {"start": load_start, "end": load_end},
              "machine": provenance.machine(),
              "wall_s": round(time.time() - started, 1)}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
