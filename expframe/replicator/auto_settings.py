"""What 'auto' means, per target: the precision (`run_experiment.precision`) and XLA
(`Replicator.jit_compile`).

Precision 'auto':
  tpu                 mixed_bfloat16 (the TPU's matrix units are bfloat16); not measured.
  any other target    measured on the first local device (`autotune`, `probes`): on
                      CPUs float32 against mixed_bfloat16 (float16 on a CPU is
                      emulated, tens of times slower: never a candidate); on GPUs
                      float32, mixed_bfloat16 and mixed_float16.

`Replicator.jit_compile` (False, True or 'auto') compiles the per-replica train step
(what `Replicator.run_steps` runs) with XLA, `tf.function(jit_compile=True)`. What
each target does, as measured with TF 2.21 (True where it fails is refused before
anything runs, one line, exit 2):
  cpu, 1 replica      works. 'auto': off, not measured: ResNet-20 ran at
                      0.61-0.77x compiled, the quickstart's ResNet-8 between 0.70x
                      and 1.77x (busy machine), a small convnet faster; one small
                      probe would answer for every model (docs/hardware.md, "Precision and
                      XLA"); set True where it pays.
  cpu, N > 1          fails: a step that updates variables mirrored on several
                      logical devices ("Trying to access resource ... located in
                      device CPU:1 from device CPU:0").
  gpu                 TensorFlow supports it (on GPUs MirroredStrategy updates each
                      replica's copy without merge_call under XLA); 'auto':
                      measured (a convnet training step with and without XLA),
                      cached like the precision. Not yet run here (no GPU):
                      benchmarks/gpu_check.py checks it.
  tpu                 every step is compiled by the TPU already: True and 'auto'
                      change nothing.
  multi_worker        CPU workers: fails (no XLA CPU kernel for the collectives,
                      "CollectiveGatherV2"); GPU workers: True is passed on, 'auto'
                      is off (not verified).
  parameter_server    fails: the step reads variables on the parameter servers
                      ("Trying to access resource ... located in device /job:ps").
  mesh                no effect: DTensor runs its SPMD program without XLA even in a
                      `jit_compile` function (no XLA module is compiled), so True is
                      refused rather than silently ignored.
A task whose train step cannot be compiled (D4PG's sends TD errors to the host with
`tf.numpy_function`) says so (`Task.xla_incompatible`): 'auto' leaves its step
uncompiled and True is refused before anything runs.
"""

from typing import Callable, Optional, Sequence, Union

import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator import autotune, probes

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "auto")
JIT_CHOICES = (False, True, "auto")
_CPU_CANDIDATES = ("float32", "mixed_bfloat16")
_GPU_CANDIDATES = ("float32", "mixed_bfloat16", "mixed_float16")


def probe_device(target: str) -> str:
    """The device 'auto' measures on: the first local GPU where the target runs on GPUs, else the CPU."""
    if target in ("gpu", "multi_worker", "parameter_server", "mesh") and tf.config.list_logical_devices("GPU"):
        return "/device:GPU:0"
    return "/device:CPU:0"


def precision_candidates(device: str) -> Sequence[str]:
    return _GPU_CANDIDATES if probes.device_type(device) == "GPU" else _CPU_CANDIDATES


def cache_key(question: str, device: str, *extra: str, cpu_flags=None) -> str:
    """The measured-choice cache's key: the question and what decides its answer, the
    hardware (`probes.hardware_id`: CPU model and deciding flags, or GPU model) and the
    TensorFlow version, then `extra` (e.g. the precision policy XLA was measured under)."""
    return "|".join((question, probes.hardware_id(device, cpu_flags), f"TensorFlow {tf.__version__}") + extra)


def agreed_precision(local: str, num_workers: int, agree: Callable[[float, str], float],
                     log: Optional[Callable[[str], None]] = None) -> str:
    """The precision every worker uses: the first, in order of preference (`PRECISIONS`,
    float32 first), of the workers' own choices, agreed with `agree(value, "min")` (a
    cross-worker minimum), and logged in one line.

    Args:
      local: this worker's measured choice.
      num_workers: workers in the cluster.
      agree: the cross-worker reduction (`Replicator.agree`).
      log: where the line goes (default stdout).
    """
    agreed = PRECISIONS[int(agree(float(PRECISIONS.index(local)), "min"))]
    (log or (lambda line: print(line, flush=True)))(
        f"expframe: run_experiment.precision='auto' -> {agreed} on all {num_workers} workers (the first in "
        f"order {', '.join(PRECISIONS[:3])} of their measured choices; this worker measured {local})")
    return agreed


def auto_precision(target: str, device: Optional[str] = None, make_timer=None, directory: Optional[str] = None,
                   log=None) -> str:
    """The Keras policy name 'auto' stands for on `target` (see `precision_choice`)."""
    return precision_choice(target, device, make_timer, directory, log).value


def precision_choice(target: str, device: Optional[str] = None, make_timer=None, directory: Optional[str] = None,
                     log=None) -> autotune.Choice:
    """What 'auto' chooses on `target` (module docstring), with the probe's timings.

    Args:
      target: the Replicator's target.
      device: where to measure (default `probe_device(target)`).
      make_timer: builds the timer (default `probes.precision_timer(device)`); tests pass a fake.
      directory: the cache directory (default `autotune.cache_dir()`).
      log: where the one line goes (default stdout).
    """
    if target == "tpu":
        return autotune.Choice("mixed_bfloat16", {}, False, "", "not measured: a TPU computes in bfloat16", None)
    device = device or probe_device(target)
    model = probes.device_model(device)
    key = cache_key("run_experiment.precision", device)
    what = f"{model} (TensorFlow {tf.__version__}; matmul + convolution)"
    return autotune.choose("run_experiment.precision", key, precision_candidates(device),
                           make_timer or (lambda: probes.precision_timer(device)), what,
                           directory=directory, log=log)


def xla_refusal(target: str, local_replicas: int, device: str) -> Optional[str]:
    """Why `Replicator.jit_compile=True` cannot work on this target, or None if it can
    (the table in the module docstring)."""
    on_cpu = probes.device_type(device) != "GPU"
    if target == "cpu" and local_replicas > 1:
        return (f"XLA cannot compile a step that updates variables mirrored on {local_replicas} logical CPU "
                "devices; use Replicator.num_replicas = 1 to compile")
    if target == "multi_worker" and on_cpu:
        return "XLA has no CPU kernels for the collectives between workers"
    if target == "parameter_server":
        return "the step reads variables on the parameter servers, which XLA cannot compile into one computation"
    if target == "mesh":
        return "DTensor runs the mesh's program without XLA, so it would have no effect"
    return None


def check_jit_compile(jit_compile: Union[bool, str], target: str, local_replicas: int) -> None:
    """ConfigError for a value that is not False/True/'auto', or True where XLA cannot work."""
    if not any(jit_compile is c if isinstance(c, bool) else jit_compile == c for c in JIT_CHOICES):
        raise ConfigError(f"Replicator.jit_compile={jit_compile!r}: use False, True or 'auto'.")
    refusal = jit_compile is True and xla_refusal(target, local_replicas, probe_device(target))
    if refusal:
        raise ConfigError(f"Replicator.jit_compile=True on target '{target}': {refusal}. Set "
                          "Replicator.jit_compile = False or 'auto' (which compiles only where it works and pays).")


def auto_jit_compile(target: str, local_replicas: int, device: Optional[str] = None, make_timer=None,
                     directory: Optional[str] = None, log=None) -> bool:
    """Whether 'auto' compiles the step (see the module docstring); measured on GPUs."""
    choice = jit_choice(target, local_replicas, device, make_timer, directory, log)
    return choice is not None and choice.value == "on"


def jit_choice(target: str, local_replicas: int, device: Optional[str] = None, make_timer=None,
               directory: Optional[str] = None, log=None) -> Optional[autotune.Choice]:
    """The measured 'auto' choice of XLA ("off"/"on") where it is measured (GPUs on the
    'gpu' target), else None: off without measuring (module docstring)."""
    device = device or probe_device(target)
    if target in ("tpu", "multi_worker") or xla_refusal(target, local_replicas, device):
        return None  # a TPU compiles anyway; GPU workers: not verified
    if probes.device_type(device) != "GPU":
        return None  # documented per target: on CPUs it pays for some models only
    model = probes.device_model(device)
    policy = _policy_name()
    key = cache_key("Replicator.jit_compile", device, policy)
    what = f"{model} (TensorFlow {tf.__version__}, {policy}; a convnet training step)"
    dtype = probes.COMPUTE_DTYPES.get(policy, tf.float32)
    return autotune.choose("Replicator.jit_compile", key, ("off", "on"),
                           make_timer or (lambda: probes.xla_timer(device, dtype=dtype)), what,
                           directory=directory, log=log)


def _policy_name() -> str:
    import keras  # pylint: disable=import-outside-toplevel
    return keras.mixed_precision.global_policy().name
