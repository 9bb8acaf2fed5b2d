"""The planner's model: step time, communication and memory on N devices.

    step = device + communication + input + host       (no overlap: TensorFlow's default
                                                         loop reduces the gradients after
                                                         the backward pass)
Device (an accelerator; `device_time`), per replica, two roofs summed, since a step's
convolutions run at the compute roof and its element-wise and normalisation layers at
the bandwidth roof, one after the other:

    compute = FLOPs / (peak x u) x (1 + fill / per-replica batch)
    memory  = (traffic x saved-activation bytes + 2 params + grads + 2 slots) / HBM bandwidth

u is the compute efficiency of the math unit the precision runs on (fp32, TF32, 16-bit
Tensor Cores, a TPU's MXU), `traffic` the bytes a step moves per byte of activation it
saves (per kind), both fitted to published ResNet-50 measurements (expframe/plan/
anchors.py); `fill` is the batch at which a GPU runs at half its rate (stated, from
NVIDIA's inference tables): small per-replica batches leave a device idle. The second
term of memory is the optimizer's pass over the variables. A TPU v2/v3 chip holds two
replicas (cores), each with half its chip's peak, bandwidth and memory. On this
machine's CPU (`shared_compute`) compute is FLOPs of the whole global batch over the
measured FLOP/s x the calibrated utilisation, as before, with no roofline.

Communication is what the step's code does (`Footprint.all_reduce_bytes` and
`Footprint.sync_bn`, recorded while the step was traced):

* every all-reduce the step makes: each optimizer update's gradients (a GAN: its
  `disc_steps` discriminator updates and its generator update), with the target's
  algorithm: a ring (MirroredStrategy over NCCL or host memory): 2(n-1)/n x bytes /
  bandwidth + 2(n-1) x latency (NCCL on GPUs: a tree's 2 ceil(log2 n) latencies, as it
  picks for small messages); hierarchical across hosts (MultiWorkerMirrored): a ring
  over the g devices of a host, then a ring over the h hosts at the host's network,
  2(g-1)/g x bytes / B_intra + 2(h-1)/h x bytes / B_inter; a TPU torus (2-D or 3-D, per
  dimension a bidirectional ring, pipelined over all links): 2(c-1)/c x bytes / B_chip +
  2 sum_d (k_d - 1) x latency over the c chips (a chip sums its cores' first), and beyond
  the largest slice a ring over the data-centre network;
* every training-mode SyncBatchNorm call all-reduces its 2C + 1 float32 shifted sums
  (count, sum and sum of squares around the moving mean, `cross_replica_moments`) over
  the replicas it normalises with (`sync_bn_bytes`): all of them, or its group of k
  (`SyncBatchNorm.group_size`), one collective group per group on CPU and GPU
  replicas, a `group_assignment` on a TPU (a group of k cores spans k / 2 chips of the
  torus), and on multi-worker clusters, which have no group collectives, one
  all-reduce of a zero-padded (n / k)-row table; where the step differentiates
  through the call the backward pass all-reduces 2C floats over the same replicas;
  where the reduction cannot sit in a cond (it needs merge_call: one host's GPUs without
  groups, multi-worker clusters), the second pass (C floats) runs every step
  (`second_pass_every_step`).
  With groups, the moving mean and variance (each group's) are averaged over all
  replicas at every update (Replicator.scope()'s MEAN aggregation: C floats each),
  waiting on nothing: where the step is compiled (XLA) the step's such all-reduces are
  independent of one another, so XLA's all-reduce combiner makes them one, of their
  summed bytes; elsewhere each is its own. The first steps' second pass (C floats, where the moving mean is still
  far from the batch's) is left out: the steady state is planned. On this machine a
  synchronised layer's cost at each device count is measured instead
  (`collective_probe`: it includes the skew between replicas the formulas leave out).

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
from typing import Dict, List, Optional, Sequence, Tuple, Union

from expframe.plan.catalogue import Hardware, Link

FLOAT32 = 4


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


def ring_all_reduce_s(num_bytes: float, n: int, link: Link, tree: bool = False) -> float:
    """Ring all-reduce of num_bytes over n devices: reduce-scatter + all-gather, 2(n-1)
    latency-bound steps; with `tree`, NCCL's choice for small messages, 2 ceil(log2 n)
    steps (its double binary tree moves the same bytes)."""
    if n <= 1:
        return 0.0
    steps = 2 * math.ceil(math.log2(n)) if tree else 2 * (n - 1)
    return 2 * (n - 1) / n * num_bytes / link.bandwidth + steps * link.latency_s


def hierarchical_all_reduce_s(num_bytes: float, per_host: int, hosts: int, intra: Link, inter: Link,
                              tree: bool = False) -> float:
    """Ring inside each host, then a ring across hosts in which each of the host's
    devices carries num_bytes / per_host over its share (1 / per_host) of the host's
    network: the cross-host term is 2(h-1)/h x num_bytes / inter.bandwidth (`tree`: the
    latency of trees, as NCCL)."""
    inside = ring_all_reduce_s(num_bytes, per_host, intra, tree)
    if hosts <= 1:
        return inside
    return inside + ring_all_reduce_s(num_bytes, hosts, inter, tree)


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


def slice_devices(hw: Hardware) -> Optional[int]:
    """The most chips one TPU torus (a slice) holds: the largest slice, else the pod."""
    return hw.max_slice_devices or hw.pod_devices


def all_reduce(hw: Hardware, n: int, num_bytes: float) -> Tuple[float, str, Link]:
    """(seconds, algorithm, the slowest link) of an all-reduce of num_bytes over n data-parallel
    devices (chips on a TPU: a chip first sums its cores')."""
    if n <= 1:
        return 0.0, "none (1 device)", hw.intra_host
    if hw.topology.startswith("torus"):
        ndim = 3 if hw.topology == "torus3d" else 2
        largest = slice_devices(hw) or n
        if n <= largest:
            dims = torus_dims(n, ndim)
            shape = "x".join(map(str, dims))
            return torus_all_reduce_s(num_bytes, dims, hw.inter_host), f"{ndim}-D torus {shape}", hw.inter_host
        slices = math.ceil(n / largest)
        inside = torus_all_reduce_s(num_bytes, torus_dims(largest, ndim), hw.inter_host)
        # Each host sends its chips' shards (devices_per_host / slice of the bytes) over its DCN link.
        dcn = hw.multi_slice or hw.inter_host
        across = ring_all_reduce_s(num_bytes * hw.devices_per_host / largest, slices, dcn)
        return (inside + across, f"torus per slice of {largest} chips + ring over {slices} slices ({dcn.name})",
                dcn)
    per_host = min(n, hw.devices_per_host)
    hosts = math.ceil(n / per_host)
    tree = hw.kind == "gpu"  # NCCL: trees for small messages (the latency), rings for large
    kind = "NCCL ring/tree" if tree else "ring"
    if hosts == 1:
        return (ring_all_reduce_s(num_bytes, n, hw.intra_host, tree), f"{kind} over {n} ({hw.intra_host.name})",
                hw.intra_host)
    seconds = hierarchical_all_reduce_s(num_bytes, per_host, hosts, hw.intra_host, hw.inter_host, tree)
    return (seconds, f"hierarchical: {kind} of {per_host} + of {hosts} hosts ({hw.inter_host.name})",
            hw.inter_host)


gradient_all_reduce = all_reduce  # the name the planner's earlier callers use


def sync_bn_target(hw: Hardware, n: int) -> str:
    """The strategy n replicas of `hw` run under: 'tpu', 'gpu' (one host's GPUs,
    MirroredStrategy with NCCL), 'cpu' (logical CPU replicas) or 'multi_worker'."""
    if hw.kind == "tpu":
        return "tpu"
    one_host = n <= hw.devices_per_host
    if hw.kind == "gpu":
        return "gpu" if one_host else "multi_worker"
    return "cpu" if one_host else "multi_worker"


def span(n: int, group: Optional[int]) -> int:
    """The replicas one SyncBatchNorm call normalises over: its group, or all n."""
    return n if group is None or group >= n else int(group)


def second_pass_every_step(target: str, n: int, group: Optional[int]) -> bool:
    """Whether the SyncBatchNorm call's second pass (C floats) runs every step on this
    target: where its reduction goes through merge_call, which a cond cannot hold
    (`collectives.reduces_in_control_flow`): one host's GPUs without groups, multi-worker
    clusters always. CPU replicas, TPUs, and groups on GPUs decide per step (the steady
    state: one pass)."""
    k = span(n, group)
    if k <= 1:
        return False
    return target == "multi_worker" or (target == "gpu" and k == n)


def sync_bn_bytes(target: str, n: int, channels: int, group: Optional[int] = None) -> Dict:
    """Bytes one SyncBatchNorm call moves through the busiest device's links, per pass, as
    `cross_replica_moments` reduces its 2C + 1 float32 shifted sums on each target (and,
    where `second_pass_every_step`, its C squares about the mean).

    Returns {'packed': bytes of one replica's sums, 'span': replicas reduced over,
    'passes': the forward all-reduces' bytes per replica, 'forward', 'backward' (the
    gradient: 2C floats over the same replicas), 'moving' (groups only: the moving
    mean's and variance's averages over all n, C floats each, by Replicator.scope()'s
    MEAN aggregation), 'forward_algorithm', 'moving_algorithm'}. A ring all-reduce of b
    bytes over m replicas moves 2(m - 1)/m x b through each.
    """
    packed = (2 * channels + 1) * FLOAT32
    k = span(n, group)
    passes = [packed] + ([channels * FLOAT32] if second_pass_every_step(target, n, group) else [])

    def ring(m, b):
        return 2 * (m - 1) / m * b if m > 1 else 0.0

    if target not in ("cpu", "gpu", "tpu", "multi_worker"):
        raise ValueError(f"sync_bn_bytes: unknown target {target!r}")
    if k <= 1:
        passes, forward, backward, algorithm = [], 0.0, 0.0, "none (a group of 1 replica)"
    elif k < n and target == "multi_worker":
        # No group collectives: every group writes its row of an (n / k)-row table, summed over all n.
        forward = sum(ring(n, n // k * b) for b in passes)
        backward = ring(n, n // k * 2 * channels * FLOAT32)
        algorithm = f"all-reduce of a zero-padded {n // k}-row table over {n}"
    else:
        where = {"cpu": "own CollectiveReduce", "gpu": "NCCL" if k == n else "own CollectiveReduce",
                 "tpu": "cross_replica_sum", "multi_worker": "CollectiveAllReduce"}[target]
        forward, backward = sum(ring(k, b) for b in passes), ring(k, 2 * channels * FLOAT32)
        algorithm = f"{where} all-reduce over {k} replicas" + (", and the second pass" if len(passes) > 1 else "")
    moving = ring(n, 2 * channels * FLOAT32) if k < n else 0.0
    return {"packed": packed, "span": k, "passes": passes, "forward": forward, "backward": backward,
            "moving": moving,
            "forward_algorithm": algorithm,
            "moving_algorithm": (f"the moving mean and variance averaged over all {n} replicas" if k < n
                                 else "none (the same on every replica)")}


def _all_reduce_over_s(hw: Hardware, target: str, replicas: int, num_bytes: float) -> float:
    """Seconds of one all-reduce of num_bytes over `replicas` replicas of one target (a TPU
    chip sums its cores over the chip before its links carry anything)."""
    if replicas <= 1 or num_bytes <= 0:
        return 0.0
    if target == "tpu":
        chips = replicas // max(1, hw.cores_per_chip)
        return all_reduce(hw, chips, num_bytes)[0] if chips > 1 else hw.intra_host.latency_s
    if target == "cpu":
        return ring_all_reduce_s(num_bytes, replicas, hw.intra_host)
    return all_reduce(hw, replicas, num_bytes)[0]


def _sync_bn_call_s(hw: Hardware, replicas: int, channels: int, backward: bool,
                    group: Optional[int] = None) -> Tuple[float, float, Dict]:
    """(seconds, bytes, the `sync_bn_bytes` record) of one SyncBatchNorm call's collectives
    on the critical path: forward and, where differentiated, backward (the moving
    statistics' all-reduce is priced by `plan_row`, which may combine them)."""
    target = sync_bn_target(hw, replicas)
    moved = sync_bn_bytes(target, replicas, channels, group)
    k = moved["span"]

    def one(num_bytes):  # an all-reduce of num_bytes per replica over the group
        if k < replicas and target == "multi_worker" and k > 1:  # the padded (n / k)-row table
            return _all_reduce_over_s(hw, target, replicas, replicas // k * num_bytes)
        return _all_reduce_over_s(hw, target, k, num_bytes)

    seconds = sum(one(b) for b in moved["passes"]) + (one(2 * channels * FLOAT32) if backward and k > 1 else 0.0)
    return seconds, moved["forward"] + (moved["backward"] if backward else 0.0), moved


@dataclasses.dataclass
class Settings:
    """The stated inputs of a plan (each has a default the table prints).

    utilisation: the compute roof's efficiency (achieved over peak FLOP/s); None: the
    catalogue's (fitted per math unit; this machine: its calibrated utilisation).
    compiled: whether XLA compiles the step (None: from the experiment's target and
    Replicator.jit_compile)."""
    utilisation: Optional[float]
    precision: str
    input_s_per_example: float = 0.0   # host seconds per example (over the host's cores); 0: keeps up
    host_call_s: float = 0.0           # per host call (one call runs steps_per_loop steps)
    steps_per_loop: int = 1
    compiled: Optional[bool] = None


def _activation_scale(precision: str) -> float:
    """Mixed precision keeps most saved activations in 16 bits: half of float32's bytes."""
    return 0.5 if precision.startswith("mixed") else 1.0


def compiles(fp: Footprint, hw: Hardware, st: Settings) -> bool:
    """Whether XLA compiles the step: always on a TPU; on a GPU with Replicator.jit_compile
    True or 'auto' (XLA where it pays: the compiled dispatch bounds it)."""
    if st.compiled is not None:
        return st.compiled
    if hw.kind == "tpu":
        return True
    return hw.kind == "gpu" and fp.jit_compile in (True, "auto")


def optimizer_bytes(fp: Footprint) -> float:
    """Bytes the optimizer's update moves: parameters and slots read and written, gradients read."""
    return 2 * fp.param_bytes + fp.grad_bytes + 2 * fp.slot_bytes


def device_time(fp: Footprint, hw: Hardware, per_replica: float, precision: str,
                utilisation: Optional[float] = None) -> Dict[str, float]:
    """One accelerator replica's step (see the module docstring): {'compute_s', 'hbm_s' (the
    bandwidth roof), 'efficiency' (the compute roof's u), 'traffic_bytes'}."""
    cores = max(1, hw.cores_per_chip)
    model = max(1, fp.model_axis)
    u = utilisation if utilisation is not None else hw.compute_efficiency(precision)
    peak = hw.peak(precision) / cores
    fill = hw.fill_batch
    batch = max(per_replica, 1e-9)
    compute = fp.flops(per_replica) / model / (peak * u) * (1.0 + fill / batch)
    activations = hw.traffic * _activation_scale(precision) * fp.activation_bytes(per_replica)
    traffic = (activations + optimizer_bytes(fp)) / model
    hbm = traffic / (hw.memory_bandwidth / cores)
    return {"compute_s": compute, "hbm_s": hbm, "efficiency": u, "traffic_bytes": traffic}


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
        efficiency = achieved / peak
    else:
        dev = device_time(fp, hw, per_replica, st.precision, st.utilisation)
        compute, hbm, efficiency = dev["compute_s"], dev["hbm_s"], dev["efficiency"]
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
            seconds, moved, record = _sync_bn_call_s(hw, replicas, channels, backward, group)
            sync_s += seconds
            sync_bytes += moved + record["moving"]
            if record["moving"]:
                moving += [channels * FLOAT32] * 2  # the moving mean's average, the variance's
        # The groups' moving statistics, averaged over all replicas: independent all-reduces,
        # two per call, or, compiled, one combined by XLA.
        if moving and compiles(fp, hw, st):
            sync_s += _all_reduce_over_s(hw, target, replicas, sum(moving))
        else:
            sync_s += sum(_all_reduce_over_s(hw, target, replicas, b) for b in moving)
    else:
        sync_s = 0.0
    comm = grad_s + sync_s
    device_s = compute + hbm + comm
    per_host = min(devices, hw.devices_per_host)
    input_total = st.input_s_per_example * per_replica * (1 if hw.shared_compute else per_host * hw.cores_per_chip)
    input_s = max(0.0, input_total - device_s)  # tf.data's prefetch hides what the device step covers
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
    scale = _activation_scale(st.precision)
    memory = {"params": fp.param_bytes / model, "grads": fp.grad_bytes / model, "slots": fp.slot_bytes / model,
              "activations": fp.activation_bytes(per_replica) * scale / model}
    total = sum(memory.values())
    capacity = hw.replica_memory_bytes
    parts = {"compute": compute, "hbm": hbm, "comm": comm, "input": input_s, "host": host}
    achieved_flops = fp.flops(per_replica) / model / step
    row = {"devices": devices, "data_axis": data, "replicas": replicas, "model_axis": model,
           "global_batch": global_batch, "per_replica_batch": per_replica, "step_s": step,
           **{f"{k}_s": v for k, v in parts.items()},
           "grad_all_reduce_s": grad_s, "sync_bn_s": sync_s, "all_reduce_bytes": grad_bytes,
           "sync_bn_bytes": sync_bytes, "all_reduce": algorithm, "compiled": compiled,
           "examples_per_s": global_batch * fp.examples_per_step_factor / step,
           "compute_efficiency": efficiency,
           "utilisation": achieved_flops / (peak / max(1, hw.cores_per_chip)) if not hw.shared_compute else
           fp.flops(per_replica) * data / step / peak,
           "memory_bytes": {**memory, "total": total, "device": capacity},
           "fits": total <= capacity, "shortfall_bytes": max(0.0, total - capacity),
           "bottleneck": max(parts, key=parts.get)}
    if not row["fits"]:
        row["bottleneck"] = "memory"
    return row


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
