"""The planner's model: step time, communication and memory on N devices.

    step = device + communication + input + host       (no overlap: TensorFlow's default
                                                         loop reduces the gradients after
                                                         the backward pass)

Device (an accelerator): `device_model.device_time`, two roofs (compute at the math
unit's shared efficiency and the per-replica batch; memory at the HBM bandwidth, its
traffic following the saved activations), the shorter partly hidden under the longer.
Its parameters are shared by every device of a kind, fitted to published ResNet-50
measurements (expframe/plan/anchors.py), so a device described by its datasheet alone
is planned with them. On this machine's CPU (`shared_compute`) compute is FLOPs of the
whole global batch over the measured FLOP/s x the calibrated utilisation, with no
roofline.

Communication is what the step's code does (`Footprint.all_reduce_bytes` and
`Footprint.sync_bn`, recorded while the step was traced), priced by
`collective_cost`: every all-reduce the step makes (each optimizer update's gradients: a
GAN's `disc_steps` discriminator updates and its generator update) with the target's
algorithm (a ring or NCCL's tree inside a host, hierarchical across hosts, a TPU's torus
and beyond its largest slice the data-centre network), and every training-mode
SyncBatchNorm call's 2C + 1 float32 shifted sums over its group (and 2C backward; where
the reduction cannot sit in a cond, as it needs merge_call on one host's GPUs without
groups and on multi-worker clusters, the second pass's C floats every step:
`collective_cost.second_pass_every_step`). With groups, the moving mean and variance
(each group's) are averaged over all replicas at every update (Replicator.scope()'s MEAN
aggregation: C floats each), waiting on nothing: where the step is compiled (XLA) the
step's such all-reduces are independent of one another, so XLA's all-reduce combiner
makes them one, of their summed bytes; elsewhere each is its own. The first steps'
second pass (C floats, where the moving mean is still far from the batch's) is left out:
the steady state is planned. On this machine a synchronised layer's cost at each device
count is measured instead (`collective_probe`: it includes the skew between replicas the
formulas leave out). A step over several GPUs also pays TensorFlow's fixed cost of such
a step (`device_model.step_sync_s`, fitted), counted with communication.

Input (`input_time`): one host's CPU preprocesses the examples of the devices it holds;
tf.data's prefetch hides that under the device step, and what is longer than the device
step adds to it: the step is then bound by input. Predicted from a per-core rate and the
host's cores (input_bound.py chooses where), or stated as host seconds per example.

Host: per host call (`--host_ms`, spread over steps_per_loop steps) plus dispatching the
step: on the CPU the executor's ops, once per replica (logical replicas and loopback
workers share the same cores, as many at once as there are cores); on a GPU the
executor's ops, or, when the step is compiled with XLA (`Replicator.jit_compile` True or
'auto', which compiles where it pays), its kernels (`Footprint.compiled_kernels`), a
launch each: it shows only when it exceeds the device's work; 0 on a TPU, whose step
XLA compiles whole. On this machine the per-op cost and the utilisation come from two
1-replica steps, at the global batch and at a small batch (`calibrated_host`).
Everything here is plain Python.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Tuple, Union

from expframe.plan.catalogue import Hardware

# The collective formulas and the device model, under the names the planner's callers use.
from expframe.plan.collective_cost import (  # noqa: F401
    FLOAT32,
    all_reduce,
    all_reduce_over_s,
    gradient_all_reduce,
    hierarchical_all_reduce_s,
    ring_all_reduce_s,
    second_pass_every_step,
    slice_devices,
    small_all_reduce_s,
    span,
    sync_bn_bytes,
    sync_bn_call_s,
    sync_bn_target,
    torus_all_reduce_s,
    torus_dims,
)
from expframe.plan.device_model import (  # noqa: F401
    TENSORFLOW,
    Stack,
    activation_scale,
    device_time,
    optimizer_bytes,
    step_sync_s,
)


@dataclasses.dataclass
class Footprint:
    """What one training step of the experiment is made of, measured by `measure.py`.

    FLOPs and activation bytes are per replica: `a + b x per_replica_batch` (fitted from
    traces at two batch sizes); bytes of activations are at float32.

    Attributes (beyond the sizes):
      sync_collectives: training-mode SyncBatchNorm calls per step.
      all_reduce_bytes: bytes of each all-reduce the step makes (one per optimizer update);
        None: one all-reduce of grad_bytes.
      sync_bn: [channels, backward, group_size] per SyncBatchNorm call (backward: the
        step differentiates through it; group_size None: all replicas; a missing third
        entry is None); None: sync_collectives calls of unknown width.
      compiled_kernels: kernels the step launches when XLA compiles it (0: ops).
      jit_compile, target: the experiment's Replicator.jit_compile and target.
    """
    flops_fixed: float
    flops_per_example: float
    param_bytes: float
    grad_bytes: float
    slot_bytes: float
    activation_bytes_fixed: float
    activation_bytes_per_example: float
    num_params: int
    sync_collectives: int = 0
    ops: int = 0
    examples_per_step_factor: float = 1.0  # examples a step consumes per global-batch example (a GAN: disc_steps)
    precision: str = "float32"
    model_axis: int = 1
    all_reduce_bytes: Optional[List[float]] = None
    sync_bn: Optional[List[List]] = None
    compiled_kernels: int = 0
    jit_compile: Union[bool, str] = "auto"
    target: str = "cpu"

    def flops(self, per_replica_batch: float) -> float:
        return self.flops_fixed + self.flops_per_example * per_replica_batch

    def activation_bytes(self, per_replica_batch: float) -> float:
        return self.activation_bytes_fixed + self.activation_bytes_per_example * per_replica_batch

    def all_reduces(self) -> List[float]:
        """Bytes of each all-reduce of the step, in order."""
        if self.all_reduce_bytes is not None:
            return [float(b) for b in self.all_reduce_bytes]
        return [self.grad_bytes] if self.grad_bytes else []

    def sync_calls(self) -> List[Tuple[int, bool, Optional[int]]]:
        """(channels, backward, group size or None) per SyncBatchNorm call of the step."""
        if self.sync_bn is not None:
            return [(int(c[0]), bool(c[1]), None if len(c) < 3 or c[2] is None else int(c[2])) for c in self.sync_bn]
        return [(0, True, None)] * self.sync_collectives


@dataclasses.dataclass
class Settings:
    """The stated inputs of a plan (each has a default the table prints).

    utilisation: the compute roof's efficiency (achieved over peak FLOP/s); None: the
    device model's (shared per math unit; this machine: its calibrated utilisation).
    compiled: whether XLA compiles the step (None: from the experiment's target and
    Replicator.jit_compile).
    stack: the software that runs the step (this framework's: TensorFlow; the published
    rows the model is checked against name theirs).
    input_core_s_per_example: 1 / (a per-core input rate x host_core_factor), charged over
    the host's cores (Hardware.host_cores_per_device; input_bound.choose sets it)."""
    utilisation: Optional[float]
    precision: str
    input_s_per_example: float = 0.0   # host seconds per example (over the host's cores); 0: keeps up
    input_core_s_per_example: float = 0.0  # core-seconds per example over the host's cores; 0: not predicted
    host_call_s: float = 0.0           # per host call (one call runs steps_per_loop steps)
    steps_per_loop: int = 1
    compiled: Optional[bool] = None
    stack: Stack = TENSORFLOW


def compiles(fp: Footprint, hw: Hardware, st: Settings) -> bool:
    """Whether XLA compiles the step: always on a TPU; on a GPU with Replicator.jit_compile
    True or 'auto' (XLA where it pays: the compiled dispatch bounds it)."""
    if st.compiled is not None:
        return st.compiled
    if hw.kind == "tpu":
        return True
    return hw.kind == "gpu" and fp.jit_compile in (True, "auto")


def plan_row(fp: Footprint, hw: Hardware, devices: int, global_batch: int, st: Settings) -> Dict:
    """One row of the plan: `devices` devices (chips or GPUs; data x model axis) at `global_batch`."""
    model = max(1, fp.model_axis)
    data = max(1, devices // model)              # devices on the data axis
    replicas = data * max(1, hw.cores_per_chip)  # data-parallel replicas (2 per TPU v2/v3 chip)
    per_replica = global_batch / replicas
    peak = hw.peak(st.precision)
    if hw.shared_compute:
        # Logical CPU replicas share the machine: the whole global batch runs on one pool of cores.
        achieved = peak * (st.utilisation if st.utilisation is not None else hw.compute_efficiency(st.precision))
        compute, hbm = fp.flops(per_replica) * data / achieved, 0.0
        efficiency, roofs = achieved / peak, (compute, hbm)
    else:
        dev = device_time(fp, hw, per_replica, st.precision, st.utilisation, st.stack)
        compute, hbm, efficiency = dev["compute_s"], dev["hbm_s"], dev["efficiency"]
        roofs = (dev["compute_roof_s"], dev["hbm_roof_s"])
    grad_s, algorithm, grad_bytes = 0.0, "none (1 device)", 0.0
    for num_bytes in fp.all_reduces():
        seconds, algorithm, _ = all_reduce(hw, data if hw.kind == "tpu" else replicas, num_bytes / model)
        grad_s += seconds
        grad_bytes += num_bytes / model
    calls = fp.sync_calls()
    sync_bytes = 0.0
    if replicas > 1 and hw.sync_layer_s and replicas in hw.sync_layer_s:   # measured on this machine
        # the probe times a layer forward and backward; a forward-only call costs about half
        sync_s = sum(1.0 if backward else 0.5 for _, backward, _ in calls) * hw.sync_layer_s[replicas]
    elif replicas > 1:
        sync_s, moving = 0.0, []
        target = sync_bn_target(hw, replicas)
        for channels, backward, group in calls:
            seconds, moved, record = sync_bn_call_s(hw, replicas, channels, backward, group)
            sync_s += seconds
            sync_bytes += moved + record["moving"]
            if record["moving"]:
                moving += [channels * FLOAT32] * 2  # the moving mean's average, the variance's
        # The groups' moving statistics, averaged over all replicas: independent all-reduces,
        # two per call, or, compiled, one combined by XLA.
        if moving and compiles(fp, hw, st):
            sync_s += all_reduce_over_s(hw, target, replicas, sum(moving))
        else:
            sync_s += sum(all_reduce_over_s(hw, target, replicas, b) for b in moving)
    else:
        sync_s = 0.0
    synced = step_sync_s(hw, replicas, st.stack)
    comm = grad_s + sync_s + synced
    device_s = compute + hbm + comm
    per_host = min(devices, hw.devices_per_host)
    inp = input_time(hw, per_replica, per_host, device_s, st)
    input_s = max(0.0, inp["input_time_s"] - device_s)  # tf.data's prefetch hides what the device step covers
    # Dispatching the step: on a CPU the same cores pay it, once per replica (each logical
    # replica or worker process runs its own copy of the step's ops), as many at once as
    # there are cores; an accelerator hides it behind its kernels unless dispatch is slower
    # than they are (a small model: then it is the step). Compiled by XLA, a GPU step
    # launches its fused kernels instead of the executor's ops; a TPU's costs nothing here.
    compiled = compiles(fp, hw, st)
    launches = (fp.compiled_kernels or fp.ops) if (compiled and hw.kind == "gpu") else fp.ops
    dispatch = launches * hw.per_op_s * (max(1.0, replicas / hw.cores) if hw.shared_compute else 1.0)
    hidden = 0.0 if hw.shared_compute else min(dispatch, device_s)
    host = st.host_call_s / max(1, st.steps_per_loop) + dispatch - hidden
    step = device_s + input_s + host
    scale = activation_scale(st.precision)
    memory = {"params": fp.param_bytes / model, "grads": fp.grad_bytes / model, "slots": fp.slot_bytes / model,
              "activations": fp.activation_bytes(per_replica) * scale / model}
    total = sum(memory.values())
    capacity = hw.replica_memory_bytes
    parts = {"compute": compute, "hbm": hbm, "comm": comm, "input": input_s, "host": host}
    achieved_flops = fp.flops(per_replica) / model / step
    row = {"devices": devices, "data_axis": data, "replicas": replicas, "model_axis": model,
           "global_batch": global_batch, "per_replica_batch": per_replica, "step_s": step,
           **{f"{k}_s": v for k, v in parts.items()}, "compute_roof_s": roofs[0], "hbm_roof_s": roofs[1],
           "grad_all_reduce_s": grad_s, "sync_bn_s": sync_s, "step_sync_s": synced, "all_reduce_bytes": grad_bytes,
           "sync_bn_bytes": sync_bytes, "all_reduce": algorithm, "compiled": compiled,
           "examples_per_s": global_batch * fp.examples_per_step_factor / step,
           "compute_efficiency": efficiency,
           "utilisation": achieved_flops / (peak / max(1, hw.cores_per_chip)) if not hw.shared_compute else
           fp.flops(per_replica) * data / step / peak,
           "memory_bytes": {**memory, "total": total, "device": capacity},
           "fits": total <= capacity, "shortfall_bytes": max(0.0, total - capacity),
           "bottleneck": "input" if inp["input_binds"] else max(parts, key=parts.get), **inp}
    if not row["fits"]:
        row["bottleneck"] = "memory"
    return row


def input_time(hw: Hardware, per_replica: float, per_host: int, device_s: float, st: Settings) -> Dict:
    """One host's input for a step: the seconds its CPU takes to preprocess its examples,
    whether that binds the step, and the cores that would keep up with the device step.

    Examples per host per step: the per-replica batch x the replicas of the devices on one
    host (on this machine's logical replicas one replica's batch, as the stated time per
    example has always been charged there). Predicted (`st.input_core_s_per_example`, the
    host's cores known: `Hardware.host_cores_per_device` x its devices): examples x
    core-seconds per example / the host's cores; stated (`st.input_s_per_example`, host
    seconds per example over the host's cores): examples x it. On an accelerator the input
    binds where it takes longer than the device step, which tf.data's prefetch otherwise
    hides it under; this machine's rows (shared compute) keep their bottleneck as before.

    Returns the row's input fields: input_time_s, input_examples_per_host,
    input_host_cores (None: not known), input_cores_needed (cores that keep the input
    within the device step; None: not known), input_service_cores (cores needed beyond
    the host's, per host, rounded up: what tf.data service workers elsewhere would add;
    0 where the input keeps up) and input_binds.
    """
    host_examples = per_replica * (1 if hw.shared_compute else per_host * hw.cores_per_chip)
    host_cores = None if hw.shared_compute or not hw.host_cores_per_device else hw.host_cores_per_device * per_host
    if st.input_core_s_per_example and host_cores:
        core_s = st.input_core_s_per_example
        seconds = host_examples * core_s / host_cores
    else:
        seconds = st.input_s_per_example * per_replica * (1 if hw.shared_compute else per_host * hw.cores_per_chip)
        core_s = st.input_s_per_example * host_cores if host_cores else 0.0
    needed = host_examples * core_s / device_s if core_s and device_s > 0 else None
    service = None if needed is None else max(0, math.ceil(needed - host_cores - 1e-9))
    return {"input_time_s": seconds, "input_examples_per_host": host_examples, "input_host_cores": host_cores,
            "input_cores_needed": needed, "input_service_cores": service,
            "input_binds": not hw.shared_compute and seconds > device_s}


def add_schedule(row: Dict, examples_per_epoch: Optional[int], train_steps: int) -> None:
    """Time per epoch and to the experiment's last step (Trainer.train_steps)."""
    row["epoch_s"] = examples_per_epoch / row["examples_per_s"] if examples_per_epoch else None
    row["to_last_step_s"] = train_steps * row["step_s"]


def add_efficiency(rows: List[Dict], fp: Footprint, hw: Hardware, st: Settings) -> None:
    """Two scaling efficiencies per row, each meaning one thing:

    * strong: the same global batch on more devices, against the smallest device count
      planned: examples/s on n / (n / n_min x examples/s on n_min);
    * weak: the same per-replica batch, against one device (chip or GPU) holding its
      replicas: examples/s on n / (n x examples/s on one).
    `efficiency` keeps the strong figure."""
    if not rows:
        return
    base = min(rows, key=lambda r: r["devices"])
    for row in rows:
        if row["global_batch"] == base["global_batch"]:
            scaled = base["examples_per_s"] * row["devices"] / base["devices"]
            row["strong_efficiency"] = row["examples_per_s"] / scaled
        else:
            row["strong_efficiency"] = None
        model = max(1, fp.model_axis)
        one_batch = max(1, round(row["per_replica_batch"] * max(1, hw.cores_per_chip)))
        one = plan_row(fp, hw, model, one_batch, st)
        row["weak_efficiency"] = row["examples_per_s"] / (row["data_axis"] * one["examples_per_s"])
        row["efficiency"] = row["strong_efficiency"]


def calibrated_host(fp: Footprint, hw: Hardware, global_batch: int, small_batch: int, st: Settings,
                    measured_s: float, measured_small_s: float) -> Tuple[float, float]:
    """(utilisation, per_op_s) at which the model's 1-device step equals two measured step
    times, at `global_batch` and at `small_batch`: their difference is compute on the
    examples between them (the utilisation), what is left at the small batch is the
    step's fixed host time (dispatch, per op of the traced step).

    Where the small batch's step leaves no host time (its examples are cheaper than the
    large batch's: activations that fit in cache), the two steps cannot be separated:
    the utilisation is then calibrated on the large batch alone and the per-op time is
    the hardware's (`calibrated_utilisation`).
    """
    big, small = fp.flops(global_batch), fp.flops(small_batch)
    if measured_s <= measured_small_s or big <= small:
        raise ValueError(f"the step at batch {global_batch} ({measured_s:.4g} s) must take longer than at batch "
                         f"{small_batch} ({measured_small_s:.4g} s) to separate compute from host time")
    utilisation = (big - small) / (hw.peak(st.precision) * (measured_s - measured_small_s))
    per_call = st.host_call_s / max(1, st.steps_per_loop)
    fixed = measured_small_s - small / (hw.peak(st.precision) * utilisation) - per_call
    if fixed <= 0:
        return calibrated_utilisation(fp, hw, 1, global_batch, st, measured_s), hw.per_op_s
    return utilisation, fixed / max(1, fp.ops)


def calibrated_utilisation(fp: Footprint, hw: Hardware, devices: int, global_batch: int, st: Settings,
                           measured_step_s: float) -> float:
    """The utilisation at which the model's step on `devices` equals a measured step time:
    what is not compute (communication, input, host) is kept, compute absorbs the rest."""
    at_peak = plan_row(fp, hw, devices, global_batch, dataclasses.replace(st, utilisation=1.0))
    rest = at_peak["step_s"] - at_peak["compute_s"]
    if measured_step_s <= rest:
        raise ValueError(f"measured step {measured_step_s:.4g} s is no longer than the modelled non-compute time "
                         f"{rest:.4g} s: nothing left to calibrate compute against")
    return at_peak["compute_s"] / (measured_step_s - rest)
