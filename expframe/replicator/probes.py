"""The probes that `autotune` times: what runs on a device to measure a choice.

* `precision_timer`: a chain of matrix products and 3x3 convolutions (the two kinds
  of op that dominate the models shipped here) in the compute dtype of each Keras
  precision policy: float32, bfloat16 (`mixed_bfloat16`), float16 (`mixed_float16`).
* `xla_timer`: one training step of a small convolutional network (convolutions,
  normalisation, ReLU, a dense layer, softmax cross-entropy, gradients and an SGD
  update: the element-wise work XLA fuses) with and without `jit_compile`.

Sizes are per device type: a CPU probe takes tens of milliseconds per run, a GPU
probe a few (large enough that kernels, not launches, dominate).
"""

import time
from typing import Callable, Dict, Iterable, Optional

import tensorflow as tf

from expframe import provenance
from expframe.replicator.autotune import Timer

COMPUTE_DTYPES = {"float32": tf.float32, "mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}

# (matmul n, conv batch, conv spatial size, conv channels, chain length) per device type.
_PRECISION_SIZES = {"CPU": (384, 4, 24, 64, 3), "GPU": (4096, 32, 56, 256, 8)}
_TINY_PRECISION_SIZES = (32, 1, 6, 8, 1)
# (batch, spatial size, channels, steps per run) of the XLA probe.
_XLA_SIZES = {"CPU": (16, 16, 32, 2), "GPU": (64, 32, 128, 10)}
_TINY_XLA_SIZES = (2, 4, 4, 1)


def device_type(device: str) -> str:
    """'CPU' or 'GPU' (or another type) from a device name."""
    return tf.DeviceSpec.from_string(device).device_type or "CPU"


def device_model(device: str) -> str:
    """A name for the hardware behind `device`: the CPU's model name, or the GPU's name
    and compute capability."""
    kind = device_type(device)
    if kind == "GPU":
        index = tf.DeviceSpec.from_string(device).device_index or 0
        gpus = tf.config.list_physical_devices("GPU")
        if index < len(gpus):
            details = tf.config.experimental.get_device_details(gpus[index])
            capability = details.get("compute_capability")
            cc = f" (compute capability {capability[0]}.{capability[1]})" if capability else ""
            return f"GPU {details.get('device_name', 'unknown')}{cc}"
        return "GPU unknown"
    return "CPU " + provenance.cpu_name()


# CPU flags that change what bfloat16/float16 and XLA cost: the vector units, their
# bfloat16 and float16 dot products, and the AMX tiles. Other flags do not enter the key.
DECIDING_CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                      "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_fp16", "amx_int8")


def hardware_id(device: str, cpu_flags: Optional[Iterable[str]] = None) -> str:
    """What decides a measured choice on `device`, for the cache's key: a GPU's name and
    compute capability; a CPU's model name and those of its flags (from /proc/cpuinfo)
    that change its arithmetic (`DECIDING_CPU_FLAGS`), e.g. "CPU AMD EPYC 7B13 [avx avx2
    f16c fma]" against "CPU AMD EPYC 9B14 [... avx512_bf16 avx512f ...]".

    Args:
      device: a device name, e.g. "/device:CPU:0".
      cpu_flags: the CPU's flags (default: this machine's); tests pass fakes.
    """
    model = device_model(device)
    if device_type(device) == "GPU":
        return model
    flags = set(provenance.cpu_flags() if cpu_flags is None else cpu_flags)
    deciding = [f for f in DECIDING_CPU_FLAGS if f in flags]
    return f"{model} [{' '.join(sorted(deciding)) if deciding else 'no vector flags'}]"


def _timed(fn: Callable[[], tf.Tensor]) -> float:
    start = time.perf_counter()
    fn().numpy()  # waits for the device
    return time.perf_counter() - start


def _first_untimed(runs: Dict[str, Callable[[], tf.Tensor]]) -> Timer:
    """A timer whose first run of each candidate (tracing, autotuning) is not timed."""
    warm = set()

    def timer(candidate: str) -> float:
        if candidate not in warm:
            runs[candidate]().numpy()
            warm.add(candidate)
        return _timed(runs[candidate])
    return timer


def precision_timer(device: str, tiny: bool = False) -> Timer:
    """Times a chain of matmuls and convolutions on `device` in each policy's compute dtype.

    Each product feeds the next (nothing can be hoisted or skipped); the operands are
    scaled so that values stay near 1 (no overflow, no slow denormals).
    """
    n, batch, size, channels, chain = _TINY_PRECISION_SIZES if tiny else _PRECISION_SIZES.get(
        device_type(device), _PRECISION_SIZES["CPU"])
    runs = {}
    with tf.device(device):
        a32 = tf.random.stateless_normal((n, n), seed=(1, 2))
        b32 = tf.random.stateless_normal((n, n), seed=(3, 4)) / n ** 0.5
        x32 = tf.random.stateless_normal((batch, size, size, channels), seed=(5, 6))
        w32 = tf.random.stateless_normal((3, 3, channels, channels), seed=(7, 8)) / (9 * channels) ** 0.5
    for policy, dtype in COMPUTE_DTYPES.items():
        def run(dtype=dtype):
            with tf.device(device):
                return _chain(tf.cast(a32, dtype), tf.cast(b32, dtype), tf.cast(x32, dtype), tf.cast(w32, dtype),
                              chain)
        runs[policy] = run
    return _first_untimed(runs)


@tf.function(reduce_retracing=True)
def _chain(a, b, x, w, length):
    for _ in range(length):
        a = tf.matmul(a, b)
        x = tf.nn.conv2d(x, w, strides=1, padding="SAME")
    return tf.cast(a[0, 0], tf.float32) + tf.cast(x[0, 0, 0, 0], tf.float32)


def xla_timer(device: str, tiny: bool = False, dtype: tf.DType = tf.float32) -> Timer:
    """Times training steps of a small convnet on `device`, candidates "off" (the
    default TensorFlow kernels) and "on" (`tf.function(jit_compile=True)`)."""
    batch, size, channels, steps = _TINY_XLA_SIZES if tiny else _XLA_SIZES.get(
        device_type(device), _XLA_SIZES["CPU"])
    with tf.device(device):
        shapes = [(3, 3, 3, channels), (3, 3, channels, channels), (3, 3, channels, channels), (channels, 10)]
        weights = [tf.Variable(tf.random.stateless_normal(shape, seed=(i, 0)) * (2.0 / (9 * shape[-2])) ** 0.5)
                   for i, shape in enumerate(shapes)]
        images = tf.random.stateless_normal((batch, size, size, 3), seed=(1, 2))
        labels = tf.range(batch) % 10

    def step():
        with tf.GradientTape() as tape:
            x = tf.cast(images, dtype)
            for w in weights[:3]:
                x = tf.nn.conv2d(x, tf.cast(w, dtype), strides=1, padding="SAME")
                mean, variance = tf.nn.moments(x, axes=[0, 1, 2])
                x = tf.nn.relu((x - mean) * tf.math.rsqrt(variance + 1e-3))
            logits = tf.cast(tf.matmul(tf.reduce_mean(x, axis=[1, 2]), tf.cast(weights[3], dtype)), tf.float32)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        for w, g in zip(weights, tape.gradient(loss, weights), strict=True):
            w.assign_sub(0.01 * g)
        return loss

    def steps_of(compiled_step):
        def run():
            with tf.device(device):
                loss = compiled_step()
                for _ in range(steps - 1):
                    loss = compiled_step()
                return loss
        return run

    return _first_untimed({"off": steps_of(tf.function(step)), "on": steps_of(tf.function(step, jit_compile=True))})
