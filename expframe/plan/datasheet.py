"""A device that is not in the catalogue, described by its datasheet:
`python -m expframe.plan --hardware=FILE.json`.

The file holds what a datasheet and the system's description say, in the catalogue's
units (FLOP/s, bytes, bytes/s in one direction summed over a device's links, seconds):

    {"name": "h100_pcie", "kind": "gpu",
     "peak_flops": {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
     "memory_bytes": 80e9, "memory_bandwidth": 2.0e12, "devices_per_host": 8,
     "intra_host": {"name": "PCIe Gen5 x16", "bandwidth": 64e9, "latency_s": 1e-5},
     "inter_host": {"name": "8 x 200 Gbit/s", "bandwidth": 200e9, "latency_s": 1e-5},
     "sources": {"peak_flops": "the datasheet, dense (half the sparse figures)", ...}}

Required: kind ('gpu' or 'tpu'), peak_flops (dense, per precision key: fp32, tf32,
bf16, fp16; at least one), memory_bytes, memory_bandwidth, devices_per_host,
intra_host and inter_host (each a name, a bandwidth and a latency). Optional: name
(default: the file's), topology ('ring' for a GPU, 'torus2d' or 'torus3d' for a TPU),
cores_per_chip, matrix_keys (the peak keys on matrix units; default: all but fp32 on a
GPU), pod_devices, max_slice_devices, multi_slice (a link), per_op_us (a GPU's launch,
default 5, assumed as the catalogue's), host_cpu (the host's CPU: a name and its physical
'cores', or its 'vcpus', halved to cores, for devices_per_host devices; without it the
input of an ImageNet experiment is assumed to keep up), sources. The device model's parameters are
not the device's: they are shared by every device of its kind (hardware.json), and the
plan says that it was made with them alone. A malformed file is one line naming the
file and the field (ConfigError).
"""

import json
import os
from typing import Dict, Optional

from expframe.errors import ConfigError
from expframe.plan import catalogue
from expframe.plan.catalogue import Hardware, Link

_DEFAULT_TOPOLOGY = {"gpu": "ring", "tpu": "torus2d"}


def is_datasheet(name: str) -> bool:
    """Whether --hardware names a file rather than a catalogue entry."""
    return name.lower().endswith(".json") or os.path.sep in name


def _fail(path: str, field: str, problem: str) -> ConfigError:
    return ConfigError(f"--hardware={path}: field '{field}' {problem}")


def _positive(path: str, field: str, value, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _fail(path, field, f"must be a positive number ({unit}), got {value!r}")
    return float(value)


def _count(path: str, field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(path, field, f"must be a whole number of at least 1, got {value!r}")
    return value


def _link(path: str, field: str, entry) -> Link:
    if not isinstance(entry, dict):
        raise _fail(path, field, f"must be an object with name, bandwidth (bytes/s) and latency_s, got {entry!r}")
    for key in ("name", "bandwidth", "latency_s"):
        if key not in entry:
            raise _fail(path, f"{field}.{key}", "is missing")
    latency = entry["latency_s"]
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
        raise _fail(path, f"{field}.latency_s", f"must be a number of seconds >= 0, got {latency!r}")
    return Link(str(entry["name"]), _positive(path, f"{field}.bandwidth", entry["bandwidth"], "bytes/s"),
                float(latency))


def _per_op_us(path: str, value, kind: str) -> float:
    if value is None:
        return 5.0 if kind == "gpu" else 0.0  # the catalogue's assumed launch; a TPU's step is compiled whole
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _fail(path, "per_op_us", f"must be a number of microseconds >= 0, got {value!r}")
    return float(value)


def load(path: str) -> Hardware:
    """The device `path` describes (see the module docstring); ConfigError if malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except OSError as e:
        raise ConfigError(f"--hardware={path}: cannot read it ({e.strerror}); give a catalogue device or a "
                          "datasheet file (docs/planning.md)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--hardware={path}: not JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(entry, dict):
        raise ConfigError(f"--hardware={path}: must hold one JSON object, the device's datasheet")
    for field in ("kind", "peak_flops", "memory_bytes", "memory_bandwidth", "devices_per_host", "intra_host",
                  "inter_host"):
        if field not in entry:
            raise _fail(path, field, "is missing (see docs/planning.md, 'A device described by its datasheet')")
    kind = entry["kind"]
    if kind not in catalogue.KINDS:
        raise _fail(path, "kind", f"must be one of {', '.join(catalogue.KINDS)}, got {kind!r}")
    peaks = entry["peak_flops"]
    if not isinstance(peaks, dict) or not peaks:
        raise _fail(path, "peak_flops", f"must map precision keys ({', '.join(catalogue.PEAK_KEYS)}) to FLOP/s")
    for key, value in peaks.items():
        if key not in catalogue.PEAK_KEYS:
            raise _fail(path, f"peak_flops.{key}", f"is not a precision key: use {', '.join(catalogue.PEAK_KEYS)}")
        _positive(path, f"peak_flops.{key}", value, "FLOP/s")
    topology = entry.get("topology", _DEFAULT_TOPOLOGY[kind])
    if topology not in catalogue.TOPOLOGIES:
        raise _fail(path, "topology", f"must be one of {', '.join(catalogue.TOPOLOGIES)}, got {topology!r}")
    matrix_keys: Optional[tuple] = None
    if "matrix_keys" in entry:
        keys = entry["matrix_keys"]
        if not isinstance(keys, list) or any(k not in catalogue.PEAK_KEYS for k in keys):
            raise _fail(path, "matrix_keys", f"must list precision keys ({', '.join(catalogue.PEAK_KEYS)})")
        matrix_keys = tuple(entry["matrix_keys"])
    host_cpu, cores = (catalogue.host_cores(entry["host_cpu"], f"--hardware={path}")
                       if "host_cpu" in entry else (None, None))
    optional_counts = {k: _count(path, k, entry[k]) for k in ("pod_devices", "max_slice_devices") if k in entry}
    sources: Dict[str, str] = {k: str(v) for k, v in entry.get("sources", {}).items()}
    sources.setdefault("datasheet", f"described by {path}")
    return Hardware(
        name=str(entry.get("name") or os.path.splitext(os.path.basename(path))[0]), kind=kind, topology=topology,
        devices_per_host=_count(path, "devices_per_host", entry["devices_per_host"]),
        peak_flops={k: float(v) for k, v in peaks.items()},
        memory_bytes=_positive(path, "memory_bytes", entry["memory_bytes"], "bytes"),
        memory_bandwidth=_positive(path, "memory_bandwidth", entry["memory_bandwidth"], "bytes/s"),
        intra_host=_link(path, "intra_host", entry["intra_host"]),
        inter_host=_link(path, "inter_host", entry["inter_host"]),
        multi_slice=_link(path, "multi_slice", entry["multi_slice"]) if "multi_slice" in entry else None,
        utilisation=None, overlap=False, sources=sources,
        per_op_s=_per_op_us(path, entry.get("per_op_us"), kind) * 1e-6,
        cores_per_chip=_count(path, "cores_per_chip", entry.get("cores_per_chip", 1)),
        efficiency=catalogue.efficiency_parameters(), matrix_keys=matrix_keys, datasheet=path, host_cpu=host_cpu,
        host_cores_per_device=cores / entry["devices_per_host"] if cores else None, **optional_counts)
