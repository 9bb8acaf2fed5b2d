"""What the step's collectives cost (expframe/plan/model.py's communication term), as the
code does them on each target:

* every all-reduce the step makes (each optimizer update's gradients): a ring
  (MirroredStrategy over NCCL or host memory), 2(n-1)/n x bytes / bandwidth + 2(n-1) x
  latency (NCCL on GPUs: a tree's 2 ceil(log2 n) latencies, as it picks for small
  messages); hierarchical across hosts (MultiWorkerMirrored): a ring over the g devices
  of a host, then a ring over the h hosts at the host's network; a TPU torus (2-D or
  3-D, per dimension a bidirectional ring, pipelined over all links): 2(c-1)/c x bytes /
  B_chip + 2 sum_d (k_d - 1) x latency over the c chips (a chip sums its cores' first),
  and beyond the largest slice a ring over the data-centre network;
* every training-mode SyncBatchNorm call's 2C + 1 float32 shifted sums over the
  replicas it normalises with (`sync_bn_bytes`): all of them, or its group of k
  (`SyncBatchNorm.group_size`), one collective group per group on CPU and GPU
  replicas, a `group_assignment` on a TPU (a group of k cores spans k / 2 chips of the
  torus), and on multi-worker clusters, which have no group collectives, one
  all-reduce of a zero-padded (n / k)-row table; where the step differentiates
  through the call the backward pass all-reduces 2C floats over the same replicas.

Links are the catalogue's (expframe/plan/hardware.json): bandwidth in bytes/s each way
summed over a device's links, and the latency of one step of an algorithm. Plain Python.
"""

import math
from typing import Dict, Optional, Sequence, Tuple

from expframe.plan.catalogue import Hardware, Link

FLOAT32 = 4

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


def all_reduce_over_s(hw: Hardware, target: str, replicas: int, num_bytes: float) -> float:
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


def sync_bn_call_s(hw: Hardware, replicas: int, channels: int, backward: bool,
                    group: Optional[int] = None) -> Tuple[float, float, Dict]:
    """(seconds, bytes, the `sync_bn_bytes` record) of one SyncBatchNorm call's collectives
    on the critical path: forward and, where differentiated, backward (the moving
    statistics' all-reduce is priced by `plan_row`, which may combine them)."""
    target = sync_bn_target(hw, replicas)
    moved = sync_bn_bytes(target, replicas, channels, group)
    k = moved["span"]

    def one(num_bytes):  # an all-reduce of num_bytes per replica over the group
        if k < replicas and target == "multi_worker" and k > 1:  # the padded (n / k)-row table
            return all_reduce_over_s(hw, target, replicas, replicas // k * num_bytes)
        return all_reduce_over_s(hw, target, k, num_bytes)

    seconds = sum(one(b) for b in moved["passes"]) + (one(2 * channels * FLOAT32) if backward and k > 1 else 0.0)
    return seconds, moved["forward"] + (moved["backward"] if backward else 0.0), moved
