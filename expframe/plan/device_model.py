"""One accelerator replica's step: the device model, whose parameters are shared by every
device of a kind (hardware.json 'efficiency'), so a device's own figures (its peaks,
memory bandwidth and links: its datasheet) are all the model needs of it.

Two roofs, per replica:

    compute = FLOPs / (peak x u) x (1 + fill / per-replica batch)
    memory  = (traffic x saved-activation bytes + 2 params + grads + 2 slots) / HBM bandwidth
    device  = max(compute, memory) + serial x min(compute, memory)

* u is the efficiency of the math unit the precision runs on, one value per unit for
  every generation: `u_matrix` for matrix units (V100, A100 and H100 Tensor Cores in 16
  bits, a TPU's MXUs), times `tf32_ratio` where float32 runs in TF32 on Tensor Cores;
  `u_vector` for the CUDA cores (P100, V100 float32). The fraction of peak a device
  reaches then follows from its own balance: a V100 in float32 (15.7 TFLOP/s against
  900 GB/s) is bound by its compute roof, an H100 in 16 bits (989 TFLOP/s against
  3.35 TB/s) by its memory roof;
* `fill` is the per-replica batch at which the compute roof runs at half its rate (a
  small batch leaves the device idle), one per kind (a GPU, a TPU core);
* `traffic` is the bytes the step's element-wise and normalisation layers move per
  byte of the activations it saves: one for TensorFlow on GPUs (XLA), one for MXNet's
  fused batch-norm kernels (NVIDIA's MLPerf code), one for TPUs (XLA fuses the whole
  step); the second term of memory is the optimizer's pass over the variables;
* `serial` is the part of the shorter roof that does not hide under the longer one (1:
  the two run one after the other; 0: a pure roofline).

Which values are fitted and which stated, and the rows that pin each, are in
hardware.json and docs/planning.md; `expframe.plan.anchors` fits them. A TPU v2/v3 chip
holds two replicas (cores), each with half its chip's peak and bandwidth.

Software: the published rows the parameters are fitted to ran on several stacks; a
`Stack` says which traffic parameter a stack's GPU step has and whether it pays
TensorFlow's fixed cost of a step over several GPUs (`step_sync_s`: the collective's
launch and negotiation and the wait for the slowest GPU, fitted on NVIDIA's TensorFlow
1-vs-8-GPU tables). The planner plans this framework's step: `TENSORFLOW`. Plain Python.
"""

import dataclasses
from typing import Dict, Optional

from expframe.plan.catalogue import Hardware


@dataclasses.dataclass(frozen=True)
class Stack:
    """The software that runs a step, as far as the device model is concerned.

    Attributes:
      name: its name (anchors.json 'software').
      traffic: the traffic parameter of its GPU step ('traffic_gpu' or 'traffic_fused').
      step_sync: whether a step over several GPUs pays `step_sync_s` (TensorFlow's).
    """
    name: str
    traffic: str = "traffic_gpu"
    step_sync: bool = True


TENSORFLOW = Stack("tensorflow")  # this framework: TensorFlow, XLA, MirroredStrategy over NCCL


def activation_scale(precision: str) -> float:
    """Mixed precision keeps most saved activations in 16 bits: half of float32's bytes."""
    return 0.5 if precision.startswith("mixed") else 1.0


def optimizer_bytes(fp) -> float:
    """Bytes the optimizer's update moves: parameters and slots read and written, gradients read."""
    return 2 * fp.param_bytes + fp.grad_bytes + 2 * fp.slot_bytes


def device_time(fp, hw: Hardware, per_replica: float, precision: str, utilisation: Optional[float] = None,
                stack: Stack = TENSORFLOW) -> Dict[str, float]:
    """One accelerator replica's step (see the module docstring).

    Args:
      fp: the step's `model.Footprint`.
      hw: the device.
      per_replica: the per-replica batch.
      precision: the Keras policy.
      utilisation: the compute roof's efficiency, stated (None: the shared parameter's).
      stack: the software that runs the step.

    Returns:
      {'compute_roof_s', 'hbm_roof_s' (the two roofs), 'compute_s', 'hbm_s' (what each
      adds to the step: the longer in full, the shorter x serial; they sum to
      'device_s'), 'device_s', 'efficiency' (u), 'traffic_bytes'}.
    """
    cores = max(1, hw.cores_per_chip)
    model = max(1, fp.model_axis)
    u = utilisation if utilisation is not None else hw.compute_efficiency(precision)
    peak = hw.peak(precision) / cores
    batch = max(per_replica, 1e-9)
    compute = fp.flops(per_replica) / model / (peak * u) * (1.0 + hw.fill_batch / batch)
    activations = hw.traffic(stack.traffic) * activation_scale(precision) * fp.activation_bytes(per_replica)
    traffic = (activations + optimizer_bytes(fp)) / model
    memory = traffic / (hw.memory_bandwidth / cores)
    serial = hw.efficiency.get("serial", 1.0)
    if compute >= memory:
        compute_s, hbm_s = compute, serial * memory
    else:
        compute_s, hbm_s = serial * compute, memory
    return {"compute_roof_s": compute, "hbm_roof_s": memory, "compute_s": compute_s, "hbm_s": hbm_s,
            "device_s": compute_s + hbm_s, "efficiency": u, "traffic_bytes": traffic}


def step_sync_s(hw: Hardware, replicas: int, stack: Stack = TENSORFLOW) -> float:
    """The fixed cost of a step over several GPUs under `stack` (0 on one GPU, a TPU, a CPU)."""
    if hw.kind != "gpu" or replicas <= 1 or not stack.step_sync:
        return 0.0
    return hw.efficiency.get("step_sync_s", 0.0)
