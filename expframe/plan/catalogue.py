"""The hardware the planner plans for: published figures from hardware.json, and "this
machine" (`cpu`) measured by the replicator's probes.

A `Hardware` is one device type: its peak FLOP/s per precision, memory and memory
bandwidth, how devices are wired (a ring inside a host, a TPU torus, the largest TPU
slice), the links inside and between hosts, and the CPU cores of the reference system's
host per device (`host_cpu`: the cores whose preprocessing feeds the devices, the
planner's input bound, expframe/plan/input_bound.py): what a datasheet says. The device
model's parameters (expframe/plan/device_model.py) are not the device's: they are
shared by every device of a kind and fitted to published ResNet-50 measurements
(expframe/plan/anchors.py), so a device described by its datasheet alone
(`from_datasheet`, `--hardware=FILE.json`) is planned with them as it stands. Every
published value names its source in hardware.json (`sources`, or 'assumed'); `cpu` is
measured here, so its numbers describe the machine the planner runs on, at the load it
has now.

Precision: a Keras policy runs at the peak TensorFlow reaches with it. float32 on a
GPU with a TF32 peak (Ampere and later) is TF32 (TensorFlow's default since 2.4); on a
TPU, float32 matmuls run in bf16 passes (XLA's default precision there).
"""

import dataclasses
import functools
import json
import os
import re
import time
from typing import Dict, List, Optional, Tuple

from expframe import provenance
from expframe.errors import ConfigError

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware.json")
# A Keras precision policy -> the key of the peak it computes at (before TF32, below).
PRECISION_KEYS = {"float32": "fp32", "mixed_bfloat16": "bf16", "mixed_float16": "fp16"}
PEAK_KEYS = ("fp32", "tf32", "bf16", "fp16")
KINDS = ("gpu", "tpu")
TOPOLOGIES = ("ring", "torus2d", "torus3d")
VCPUS_PER_CORE = 2  # hyperthreads per physical core: a vendor's vCPU count is halved (hardware.json host_cores_rule)


@dataclasses.dataclass(frozen=True)
class Link:
    """A collective's path: bandwidth in bytes/s each way (summed over a device's links) and
    the latency of one step of the algorithm."""
    name: str
    bandwidth: float
    latency_s: float


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device type.

    Attributes:
      name: catalogue key ('v3', 'a100', 'cpu').
      kind: 'tpu', 'gpu' or 'cpu'.
      topology: 'ring' (NCCL / host memory), 'torus2d' or 'torus3d' (TPU ICI).
      devices_per_host: devices that share a host (and its network interface).
      peak_flops: peak FLOP/s per precision key ('fp32', 'tf32', 'bf16', 'fp16').
      memory_bytes, memory_bandwidth: one device's memory and its bandwidth (bytes/s); for
        a TPU chip of several cores, the chip's (each core, a replica, has its share).
      intra_host, inter_host: the links a collective uses inside a host and between hosts.
      multi_slice: for TPUs, the data-centre network between slices (beyond max_slice_devices).
      pod_devices: the most devices on one interconnect (a TPU pod); None: unbounded.
      max_slice_devices: the most chips one TPU slice (one torus a job gets) holds.
      cores_per_chip: replicas per device: 2 TensorCores per TPU v2/v3 chip, each a
        TPUStrategy replica; 1 elsewhere (v4/v5p run their two cores as one megacore).
      utilisation: stated achieved / peak FLOP/s of the whole step (this machine, calibrated);
        None for an accelerator, whose compute efficiency comes from `efficiency`.
      efficiency: the device model's shared parameters (hardware.json 'efficiency', the
        same for every device: expframe/plan/device_model.py).
      matrix_keys: the peak keys that run on matrix units (Tensor Cores, a TPU's MXUs);
        the others run on the vector (CUDA) cores. None: every key but fp32 on a GPU
        (Volta and later), every key on a TPU; P100 has none (its fp16 is packed on the
        CUDA cores).
      datasheet: the file a device described by its datasheet came from (None: the
        catalogue or this machine).
      overlap: whether gradient communication overlaps compute on this target.
      shared_compute: True when every replica shares one pool of compute (logical CPU
        replicas): the step's compute time is then that of the whole global batch.
      sources: where each value comes from (text).
      per_op_s: host time to dispatch one op of the step (TensorFlow's executor).
      sync_layer_s: measured seconds one synchronised batch-norm layer's collectives add
        to a step, per data-parallel device count (`collective_probe`, this machine only);
        where a count is missing the latency formula of `model.small_all_reduce_s` is used.
      cores: for shared compute, the cores its replicas share (each dispatches on one).
      host_cpu: the CPU of the host that holds the devices, as hardware.json names it (None:
        not known: this machine, or a datasheet without one).
      host_cores_per_device: that host's physical cores per device (its cores, or its vCPUs
        halved: `host_cores`), the cores whose input feeds the devices; None: not known.
    """
    name: str
    kind: str
    topology: str
    devices_per_host: int
    peak_flops: Dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    intra_host: Link
    inter_host: Link
    utilisation: Optional[float]
    overlap: bool
    sources: Dict[str, str]
    multi_slice: Optional[Link] = None
    pod_devices: Optional[int] = None
    shared_compute: bool = False
    per_op_s: float = 0.0
    sync_layer_s: Optional[Dict[int, float]] = None
    cores: int = 1
    cores_per_chip: int = 1
    max_slice_devices: Optional[int] = None
    efficiency: Dict[str, float] = dataclasses.field(default_factory=dict)
    matrix_keys: Optional[Tuple[str, ...]] = None
    datasheet: Optional[str] = None
    host_cpu: Optional[str] = None
    host_cores_per_device: Optional[float] = None

    def peak_key(self, precision: str) -> str:
        """The peak a Keras precision policy computes at: its key, TF32 for float32 where the
        GPU has it (TensorFlow's default), bf16 on a TPU (XLA's default precision runs
        float32 matmuls in bf16 passes), fp32 where the device has no peak for it."""
        key = PRECISION_KEYS.get(precision, "fp32")
        if self.kind == "tpu":
            return key if key in self.peak_flops else "bf16"
        if key == "fp32" and "tf32" in self.peak_flops:
            return "tf32"
        return key if key in self.peak_flops else "fp32"

    def peak(self, precision: str) -> float:
        """Peak FLOP/s of one device (chip) at a Keras precision policy (`peak_key`)."""
        key = self.peak_key(precision)
        return self.peak_flops.get(key) or self.peak_flops.get("fp32") or max(self.peak_flops.values())

    def peak_note(self, precision: str) -> str:
        """How `peak(precision)` was chosen, for the table's header."""
        wanted, key = PRECISION_KEYS.get(precision, "fp32"), self.peak_key(precision)
        value = f"{key} peak {self.peak(precision) / 1e12:.4g} TFLOP/s"
        if key == wanted:
            return value
        if key == "tf32":
            return f"{value} (float32 runs in TF32: TensorFlow's default on Ampere and later GPUs)"
        if self.kind == "tpu":
            return f"{value} (no {wanted} peak on TPU: XLA runs float32 matmuls in bf16 passes)"
        return f"{value} (no {wanted} peak on this device)"

    def math_unit(self, precision: str) -> str:
        """'matrix' (Tensor Cores, a TPU's MXUs) or 'vector' (a GPU's CUDA cores): where the
        step's convolutions and matmuls run at `precision`."""
        key = self.peak_key(precision)
        if self.matrix_keys is not None:
            return "matrix" if key in self.matrix_keys else "vector"
        return "matrix" if self.kind == "tpu" or key != "fp32" else "vector"

    def efficiency_key(self, precision: str) -> str:
        """The shared parameter(s) the compute roof's efficiency comes from at `precision`."""
        unit = f"u_{self.math_unit(precision)}"
        return f"{unit} x tf32_ratio" if unit == "u_matrix" and self.peak_key(precision) == "tf32" else unit

    def compute_efficiency(self, precision: str) -> float:
        """Achieved over peak FLOP/s of the compute roof (the step's convolutions and
        matmuls) at `precision`: the shared efficiency of its math unit (TF32 at its
        ratio to the 16-bit path); this machine's stated utilisation."""
        if self.utilisation is not None:
            return self.utilisation
        u = self.efficiency[f"u_{self.math_unit(precision)}"]
        if self.math_unit(precision) == "matrix" and self.peak_key(precision) == "tf32":
            u *= self.efficiency["tf32_ratio"]
        return u

    def traffic(self, stack_traffic: str = "traffic_gpu") -> float:
        """Bytes moved to and from memory per byte of saved activation: a TPU's (XLA fuses
        the whole step), a GPU's under the software stack that runs it (`stack_traffic`:
        TensorFlow's, or MXNet's fused batch-norm kernels); 0 on this CPU, whose measured
        utilisation covers the whole step."""
        if self.kind == "cpu":
            return 0.0
        return self.efficiency.get("traffic_tpu" if self.kind == "tpu" else stack_traffic, 0.0)

    @property
    def fill_batch(self) -> float:
        """Per-replica batch at which the compute roof runs at half its efficiency (fitted
        per kind: a GPU, a TPU core)."""
        return self.efficiency.get(f"fill_{self.kind}", 0.0)

    @property
    def replica_memory_bytes(self) -> float:
        """Memory of one replica: the device's, or a TPU core's share of its chip's."""
        return self.memory_bytes / max(1, self.cores_per_chip)


@functools.lru_cache(maxsize=None)
def _load() -> dict:
    """hardware.json, read once (callers do not modify it)."""
    with open(_DATA, encoding="utf-8") as f:
        return json.load(f)


def efficiency_parameters(data: Optional[dict] = None) -> Dict[str, float]:
    """The device model's parameters: hardware.json's fitted and stated 'efficiency' values."""
    block = (data or _load())["efficiency"]
    return {k: float(v) for part in ("fitted", "stated") for k, v in block[part].items()}


def efficiency_priors(data: Optional[dict] = None) -> Dict[str, float]:
    """Each fitted parameter's prior: where a fit starts, and its value when no row the fit
    sees depends on it (hardware.json 'efficiency' 'prior')."""
    return {k: float(v) for k, v in (data or _load())["efficiency"]["prior"].items()}


def names() -> List[str]:
    """Every device type the catalogue holds, plus 'cpu' (measured)."""
    return sorted(_load()["devices"]) + ["cpu"]


def _link(entry: dict) -> Link:
    return Link(entry["name"], float(entry["bandwidth"]), float(entry["latency_s"]))


def host_cores(entry: dict, where: str) -> Tuple[str, float]:
    """(description, physical cores) of a host's CPU: {"name", and "cores" or "vcpus"}. A
    count of vCPUs (hyperthreads, as cloud VMs are sold) is halved: VCPUS_PER_CORE of them
    make one core (hardware.json 'host_cores_rule'). A malformed entry is a ConfigError, one
    line beginning with `where` (the file) and naming the field."""
    if not isinstance(entry, dict) or "name" not in entry or ("cores" in entry) == ("vcpus" in entry):
        raise ConfigError(f"{where}: field 'host_cpu' must be an object with a name and either 'cores' (physical) "
                          f"or 'vcpus' (hyperthreads), got {entry!r}")
    unit = "cores" if "cores" in entry else "vcpus"
    count = entry[unit]
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ConfigError(f"{where}: field 'host_cpu.{unit}' must be a positive number, got {count!r}")
    cores = float(count) if unit == "cores" else count / VCPUS_PER_CORE
    what = f"{count:g} cores" if unit == "cores" else f"{count:g} vCPUs = {cores:g} cores"
    return f"{entry['name']}: {what}", cores


def published(name: str) -> Hardware:
    """A catalogue entry by name or alias (case-insensitive); ConfigError if unknown."""
    data = _load()
    wanted = name.lower()
    for key, entry in data["devices"].items():
        if wanted == key or wanted in entry.get("aliases", []):
            sources = {field: _expand(ref, data["sources"]) for field, ref in entry["source"].items()}
            host_cpu, cores = (host_cores(entry["host_cpu"], f"hardware.json, device {key!r}")
                               if "host_cpu" in entry else (None, None))
            return Hardware(
                name=key, kind=entry["kind"], topology=entry["topology"], devices_per_host=entry["devices_per_host"],
                peak_flops={k: float(v) for k, v in entry["peak_flops"].items()},
                memory_bytes=float(entry["memory_bytes"]), memory_bandwidth=float(entry["memory_bandwidth"]),
                intra_host=_link(entry["intra_host"]), inter_host=_link(entry["inter_host"]),
                multi_slice=_link(entry["multi_slice"]) if "multi_slice" in entry else None,
                pod_devices=entry.get("pod_devices"), utilisation=None,
                overlap=bool(entry["overlap"]), sources=sources, per_op_s=float(entry.get("per_op_us", 0.0)) * 1e-6,
                cores_per_chip=int(entry.get("cores_per_chip", 1)), max_slice_devices=entry.get("max_slice_devices"),
                efficiency=efficiency_parameters(data),
                matrix_keys=tuple(entry["matrix_keys"]) if "matrix_keys" in entry else None,
                host_cpu=host_cpu, host_cores_per_device=cores / entry["devices_per_host"] if cores else None)
    raise ConfigError(f"--hardware={name!r} is not in the catalogue (expframe/plan/hardware.json); use one of "
                      f"{', '.join(names())}.")


def _expand(ref: str, sources: Dict[str, str]) -> str:
    """'nvidia_p100; inter-host goyal_big_basin' -> each source key replaced by its text."""
    return re.sub(r"[a-z0-9_]+", lambda m: sources.get(m.group(0), m.group(0)), ref)


def _memory_bytes() -> float:
    """This machine's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _copy_bandwidth(size_bytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes/s of a large in-memory copy: what a reduction through host memory moves."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    source = np.ones(size_bytes // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return size_bytes / best


def measured_cpu(achieved_flops: float, utilisation: float = 1.0, copy_bandwidth: Optional[float] = None,
                 loopback_bandwidth: float = 1e9, latency_s: float = 5e-5, per_op_s: float = 0.0) -> Hardware:
    """'This machine': its achieved FLOP/s (from `measure.cpu_flops`, the replicator's
    precision probe) as the peak, its memory, and a copy's bandwidth as the link between
    logical replicas. Loopback workers talk over gRPC on 127.0.0.1 (`loopback_bandwidth`,
    an assumption the --inter_host_gbps flag overrides).

    Args:
      achieved_flops: FLOP/s the probe's matmuls and convolutions reached (float32).
      utilisation: fraction of it a train step reaches (1.0: the probe's rate).
      copy_bandwidth: bytes/s of a memory copy (None: measured now).
      loopback_bandwidth: bytes/s between worker processes.
      latency_s: per step of a collective (thread hand-off, gRPC call).
      per_op_s: the executor's time per op (`planner.cpu_per_op_s`, measured).
    """
    bandwidth = copy_bandwidth if copy_bandwidth is not None else _copy_bandwidth()
    measured = "measured on this machine by expframe.replicator.probes (float32 matmul and 3x3 conv chain)"
    return Hardware(
        name="cpu", kind="cpu", topology="ring", devices_per_host=1 << 30,
        peak_flops={"fp32": achieved_flops}, memory_bytes=_memory_bytes(), memory_bandwidth=bandwidth,
        intra_host=Link("host memory (logical replicas)", bandwidth, latency_s),
        inter_host=Link("gRPC over loopback (workers)", loopback_bandwidth, latency_s * 10),
        utilisation=utilisation, overlap=False, shared_compute=True, per_op_s=per_op_s,
        cores=provenance.cores(),
        sources={"peak_flops": measured, "memory": "os.sysconf (physical pages)",
                 "interconnect": "a 64 MiB numpy copy, timed here; loopback an assumption",
                 "utilisation": "1.0 of the probe's rate unless --utilisation (calibrate with a 1-replica run)",
                 "latency": "assumption", "per_op": "measured: a traced chain of small ops, timed"})
