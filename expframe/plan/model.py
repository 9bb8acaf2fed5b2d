"""The planner's model: step time, gradient communication and memory on N devices.

    step = compute + communication + input + host            (no overlap: TensorFlow's
    compute = FLOPs per replica / (peak x utilisation)        default loop reduces the
                                                              gradients after the backward pass)
Communication is the all-reduce the target runs:

* a ring (MirroredStrategy over NCCL or host memory): 2(n-1)/n x bytes / bandwidth
  + 2(n-1) x latency (reduce-scatter, then all-gather, n-1 steps each);
* hierarchical across hosts (MultiWorkerMirrored): a ring over the g devices of a host,
  then a ring over the h hosts in which each device carries bytes/g at its share
  (1/g) of the host's network: 2(g-1)/g x bytes / B_intra + 2(h-1)/h x bytes / B_inter;
* a TPU torus (2-D or 3-D, per dimension a bidirectional ring, the dimensions
  pipelined over all links): 2(n-1)/n x bytes / B_chip + 2 sum_d (k_d - 1) x latency,
  B_chip the chip's ICI bandwidth summed over its links (Google's 'all-reduce
  bandwidth per pod' divided by its chips); slices beyond a pod add a ring over DCN.

Host: per host call (`--host_ms`, spread over steps_per_loop steps) plus dispatching the
step's ops (ops x per-op cost: on the CPU it adds to the step once per replica, since
logical replicas and loopback workers share the same cores, as many at once as there are
cores; a stated launch cost on a
GPU, where it shows only when it exceeds the device's work; 0 on a TPU, whose step XLA
compiles whole). On this machine the per-op cost and the utilisation come from two
1-replica steps, at the global batch and at a small batch (`calibrated_host`).

Small collectives (SyncBatchNorm's moments, one per layer forward and one backward) are
latency-bound: 2 ceil(log2 n) x latency each (a tree); on this machine a synchronised
layer's cost at each device count is measured instead (`collective_probe`: it includes
the skew between replicas that the formula leaves out). Everything here is plain Python.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from expframe.plan.catalogue import Hardware, Link


@dataclasses.dataclass
class Footprint:
    """What one training step of the experiment is made of, measured by `measure.py`.

    FLOPs and activation bytes are per replica: `a + b x per_replica_batch` (fitted from
    traces at two batch sizes); bytes of activations are at float32.
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

    def flops(self, per_replica_batch: float) -> float:
        return self.flops_fixed + self.flops_per_example * per_replica_batch

    def activation_bytes(self, per_replica_batch: float) -> float:
        return self.activation_bytes_fixed + self.activation_bytes_per_example * per_replica_batch


def ring_all_reduce_s(num_bytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of num_bytes over n devices: reduce-scatter + all-gather."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / link.bandwidth + 2 * (n - 1) * link.latency_s


def hierarchical_all_reduce_s(num_bytes: float, per_host: int, hosts: int, intra: Link, inter: Link) -> float:
    """Ring inside each host, then a ring across hosts in which each of the host's
    devices carries num_bytes / per_host over its share (1 / per_host) of the host's
    network: the cross-host term is 2(h-1)/h x num_bytes / inter.bandwidth."""
    inside = ring_all_reduce_s(num_bytes, per_host, intra)
    if hosts <= 1:
        return inside
    across = 2 * (hosts - 1) / hosts * num_bytes / inter.bandwidth + 2 * (hosts - 1) * inter.latency_s
    return inside + across


def torus_dims(n: int, ndim: int) -> Tuple[int, ...]:
    """The most balanced shape of n chips in ndim dimensions (largest first)."""
    if ndim == 1 or n == 1:
        return (n,) + (1,) * (ndim - 1)
    best = None
    for k in range(1, n + 1):
        if n % k:
            continue
        rest = torus_dims(n // k, ndim - 1)
        shape = tuple(sorted((k,) + rest, reverse=True))
        if best is None or (max(shape), sum(shape)) < (max(best), sum(best)):
            best = shape
    return best


def torus_all_reduce_s(num_bytes: float, dims: Sequence[int], link: Link) -> float:
    """All-reduce on a torus: bandwidth-optimal over all links, latency of a bidirectional
    ring per dimension (reduce-scatter and all-gather)."""
    n = math.prod(dims)
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / link.bandwidth + 2 * sum(k - 1 for k in dims) * link.latency_s


def small_all_reduce_s(n: int, link: Link) -> float:
    """A latency-bound all-reduce (a few floats): a tree up and down."""
    return 0.0 if n <= 1 else 2 * math.ceil(math.log2(n)) * link.latency_s


def gradient_all_reduce(hw: Hardware, n: int, num_bytes: float) -> Tuple[float, str, Link]:
    """(seconds, algorithm, the slowest link) of the gradient all-reduce over n data-parallel devices."""
    if n <= 1:
        return 0.0, "none (1 device)", hw.intra_host
    if hw.topology.startswith("torus"):
        ndim = 3 if hw.topology == "torus3d" else 2
        pod = hw.pod_devices or n
        if n <= pod:
            dims = torus_dims(n, ndim)
            shape = "x".join(map(str, dims))
            return torus_all_reduce_s(num_bytes, dims, hw.inter_host), f"{ndim}-D torus {shape}", hw.inter_host
        slices = math.ceil(n / pod)
        inside = torus_all_reduce_s(num_bytes, torus_dims(pod, ndim), hw.inter_host)
        # Each host sends its chips' shards (devices_per_host / pod of the bytes) over its DCN link.
        dcn = hw.multi_slice or hw.inter_host
        across = ring_all_reduce_s(num_bytes * hw.devices_per_host / pod, slices, dcn)
        return inside + across, f"torus per slice + ring over {slices} slices ({dcn.name})", dcn
    per_host = min(n, hw.devices_per_host)
    hosts = math.ceil(n / per_host)
    if hosts == 1:
        return ring_all_reduce_s(num_bytes, n, hw.intra_host), f"ring over {n} ({hw.intra_host.name})", hw.intra_host
    seconds = hierarchical_all_reduce_s(num_bytes, per_host, hosts, hw.intra_host, hw.inter_host)
    return seconds, f"hierarchical: ring of {per_host} + ring of {hosts} hosts ({hw.inter_host.name})", hw.inter_host


@dataclasses.dataclass
class Settings:
    """The stated inputs of a plan (each has a default the table prints)."""
    utilisation: float
    precision: str
    input_s_per_example: float = 0.0   # host seconds per example (over the host's cores); 0: keeps up
    host_call_s: float = 0.0           # per host call (one call runs steps_per_loop steps)
    steps_per_loop: int = 1


def _activation_scale(precision: str) -> float:
    """Mixed precision keeps most saved activations in 16 bits: half of float32's bytes."""
    return 0.5 if precision.startswith("mixed") else 1.0


def plan_row(fp: Footprint, hw: Hardware, devices: int, global_batch: int, st: Settings) -> Dict:
    """One row of the plan: `devices` devices (data x model axis) at `global_batch`."""
    model = max(1, fp.model_axis)
    data = max(1, devices // model)
    per_replica = global_batch / data
    peak = hw.peak(st.precision)
    achieved = peak * st.utilisation
    # Logical CPU replicas share the machine: the whole global batch runs on one pool of cores.
    compute = (fp.flops(per_replica) * data if hw.shared_compute else fp.flops(per_replica) / model) / achieved
    grad_s, algorithm, link = gradient_all_reduce(hw, data, fp.grad_bytes / model)
    if data > 1 and hw.sync_layer_s and data in hw.sync_layer_s:   # measured on this machine
        sync_s = fp.sync_collectives * hw.sync_layer_s[data]
    else:                                                          # forward and backward, latency-bound
        sync_s = 2 * fp.sync_collectives * small_all_reduce_s(data, link)
    comm = grad_s + sync_s
    device_s = compute + comm
    per_host = min(devices, hw.devices_per_host)
    input_total = st.input_s_per_example * per_replica * (1 if hw.shared_compute else per_host)
    input_s = max(0.0, input_total - device_s)  # tf.data's prefetch hides what the device step covers
    # Dispatching the step's ops: on a CPU the same cores pay it, once per replica (each logical
    # replica or worker process runs its own copy of the step's ops); an accelerator hides it
    # behind its kernels unless dispatch is slower than they are (a small model: then it is the step).
    # (An op's dispatch runs on one core: the replicas' dispatch overlaps as many at once as
    # there are cores.)
    dispatch = fp.ops * hw.per_op_s * (max(1.0, data / hw.cores) if hw.shared_compute else 1.0)
    hidden = 0.0 if hw.shared_compute else min(dispatch, device_s)
    host = st.host_call_s / max(1, st.steps_per_loop) + dispatch - hidden
    step = device_s + input_s + host
    scale = _activation_scale(st.precision)
    memory = {"params": fp.param_bytes / model, "grads": fp.grad_bytes / model, "slots": fp.slot_bytes / model,
              "activations": fp.activation_bytes(per_replica) * scale / model}
    total = sum(memory.values())
    parts = {"compute": compute, "comm": comm, "input": input_s, "host": host}
    row = {"devices": devices, "data_axis": data, "model_axis": model, "global_batch": global_batch,
           "per_replica_batch": per_replica, "step_s": step, **{f"{k}_s": v for k, v in parts.items()},
           "all_reduce": algorithm, "examples_per_s": global_batch * fp.examples_per_step_factor / step,
           "memory_bytes": {**memory, "total": total, "device": hw.memory_bytes},
           "fits": total <= hw.memory_bytes, "shortfall_bytes": max(0.0, total - hw.memory_bytes),
           "bottleneck": max(parts, key=parts.get)}
    if not row["fits"]:
        row["bottleneck"] = "memory"
    return row


def add_schedule(row: Dict, examples_per_epoch: Optional[int], train_steps: int) -> None:
    """Time per epoch and to the experiment's last step (Trainer.train_steps)."""
    row["epoch_s"] = examples_per_epoch / row["examples_per_s"] if examples_per_epoch else None
    row["to_last_step_s"] = train_steps * row["step_s"]


def add_efficiency(rows: List[Dict], fp: Footprint, hw: Hardware, st: Settings) -> None:
    """Scaling efficiency against 1 device at the same per-replica batch (weak scaling):
    examples/s on n devices / (n x examples/s on one)."""
    for row in rows:
        one = plan_row(fp, hw, max(1, fp.model_axis), max(1, round(row["per_replica_batch"])), st)
        row["efficiency"] = row["examples_per_s"] / (row["data_axis"] * one["examples_per_s"])


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
