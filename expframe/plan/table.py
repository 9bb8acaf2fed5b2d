"""The plan as a table (stdout) and as JSON (--out): one row per device count."""

import json
import math
from typing import Dict, List, Optional

COLUMNS = ("devices", "global", "per-rep", "step ms", "compute", "hbm", "comm", "input", "host", "examples/s", "epoch",
           "to last step", "params", "grads", "slots", "activ.", "total", "device", "fits", "util.", "strong", "weak",
           "bottleneck")


def duration(seconds: Optional[float]) -> str:
    """'850 ms', '42 s', '3.5 min', '2.1 h', '4.2 d'; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def size(num_bytes: float) -> str:
    """Bytes in GB (1e9) with 3 significant digits, MB below 0.1 GB."""
    if num_bytes < 1e8:
        return f"{num_bytes / 1e6:.3g} MB"
    return f"{num_bytes / 1e9:.3g} GB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def _cells(row: Dict) -> List[str]:
    memory = row["memory_bytes"]
    devices = str(row["devices"])
    if row["model_axis"] > 1:
        devices += f" ({row['data_axis']}x{row['model_axis']})"
    elif row.get("replicas", row["data_axis"]) != row["data_axis"]:
        devices += f" ({row['replicas']} rep.)"
    return [devices, str(row["global_batch"]), f"{row['per_replica_batch']:g}", _ms(row["step_s"]),
            _ms(row["compute_s"]), _ms(row.get("hbm_s", 0.0)), _ms(row["comm_s"]), _ms(row["input_s"]),
            _ms(row["host_s"]), f"{row['examples_per_s']:,.0f}", duration(row.get("epoch_s")),
            duration(row.get("to_last_step_s")), size(memory["params"]), size(memory["grads"]), size(memory["slots"]),
            size(memory["activations"]), size(memory["total"]), size(memory["device"]), "yes" if row["fits"] else "NO",
            _percent(row.get("utilisation")), _percent(row.get("strong_efficiency")),
            _percent(row.get("weak_efficiency")), row["bottleneck"]]


def format_table(rows: List[Dict]) -> str:
    """Aligned text: a header and one line per row."""
    lines = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)


def format_markdown(rows: List[Dict]) -> str:
    """The same table in Markdown (for the docs)."""
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "\n".join("| " + " | ".join(_cells(r)) + " |" for r in rows)


def notes(plan: Dict) -> List[str]:
    """Lines printed under the table: what was assumed and what does not fit."""
    fp = plan["footprint"]
    reduces = fp.get("all_reduce_bytes") or ([fp["grad_bytes"]] if fp["grad_bytes"] else [])
    calls = fp.get("sync_bn") or []
    differentiated = sum(1 for call in calls if call[1])
    groups = sorted({call[2] for call in calls if len(call) > 2 and call[2] is not None})
    span = f"over groups of {', '.join(map(str, groups))} replicas" if groups else "over all replicas"
    compiled = "compiled by XLA" if plan.get("compiled") else "not compiled (the executor dispatches each op)"
    out = [f"experiment: {', '.join(plan['gin_files'])}; hardware {plan['hardware']} ({plan['peak_note']}); "
           f"precision {plan['precision']}; compute efficiency {plan['utilisation']:.3g} "
           f"({plan['utilisation_source']}); util. = achieved / peak FLOP/s of the whole step",
           f"measured per replica: {fp['flops_per_example'] / 1e9:.4g} GFLOP per example + "
           f"{fp['flops_fixed'] / 1e9:.4g} GFLOP per step; {fp['num_params']:,} parameters; "
           f"{len(reduces)} all-reduce(s) per step of {size(sum(reduces))} in all (one per optimizer update); "
           f"activations kept for backward {size(fp['activation_bytes_per_example'])} per example at float32 "
           f"(x0.5 in mixed precision); {fp['sync_collectives']} SyncBatchNorm calls per step ({differentiated} "
           f"differentiated), each all-reducing 2 x channels + 1 float32 sums {span} (as many in its backward"
           f"{'; the moving statistics one more over all replicas' if groups else ''})",
           f"communication overlaps compute: {'yes' if plan['overlap'] else 'no'} (TensorFlow's default loop "
           "reduces gradients after the backward pass); step ms = compute + hbm + comm + input + host (compute and "
           "hbm: what the device's two roofs add, the longer in full, the shorter by the part that does not hide "
           f"under it); the step is {compiled}",
           "strong = examples/s against the smallest device count at the same global batch, scaled by the device "
           "ratio; weak = examples/s against one device at the same per-replica batch, times the device count",
           f"input: {plan['input_note']}; host: {plan['host_note']}"]
    if plan.get("datasheet"):
        out.append(f"hardware {plan['hardware']}: described by its datasheet ({plan['datasheet']}), not in the "
                   "catalogue: planned with the device model's shared parameters alone (no published row of this "
                   "device was fitted); its own figures are the file's")
    if plan.get("train_epochs") is not None:
        out.append(f"to last step: Trainer.train_epochs = {plan['train_epochs']:g} is {plan['train_steps']:,} steps "
                   f"at global batch {plan['rows'][0]['global_batch']:,} ({plan['examples_per_epoch']:,} train "
                   "examples per epoch, counted as the trainer counts them)")
    if plan.get("cores_per_chip", 1) > 1:
        out.append(f"rows count chips: a {plan['hardware']} chip holds {plan['cores_per_chip']} TensorCores, each a "
                   "TPUStrategy replica (a v3-32 slice is 16 chips, 32 replicas); per-replica batch and memory are "
                   "per core")
    for row in plan["rows"]:
        sync = (f"; SyncBatchNorm {size(row['sync_bn_bytes'])} per step through the busiest device "
                f"({_ms(row['sync_bn_s'])} ms)" if row.get("sync_bn_bytes") else "")
        fixed = (f"; TensorFlow's fixed cost of a step over several GPUs {_ms(row['step_sync_s'])} ms (in comm)"
                 if row.get("step_sync_s") else "")
        out.append(f"{row['devices']} devices: all-reduce {row['all_reduce']}{sync}{fixed}")
        line = input_line(row, plan.get("devices_per_host", 1))
        if line:
            out.append(line)
        if not row["fits"]:
            out.append(f"{row['devices']} devices: does NOT fit: needs {size(row['memory_bytes']['total'])} per "
                       f"device, has {size(row['memory_bytes']['device'])}: short by "
                       f"{size(row['shortfall_bytes'])} (lower the per-replica batch or add a model axis)")
    for line in plan.get("d4pg_lines", []):
        out.append(line)
    return out


def input_line(row: Dict, devices_per_host: int) -> Optional[str]:
    """The line under the table for one row's input (None where nothing is known of its
    cores): its time per step per host against the device step, and where it binds, the
    data-service worker cores that would lift it."""
    needed, cores = row.get("input_cores_needed"), row.get("input_host_cores")
    if needed is None or cores is None:
        return None
    device_s = row["compute_s"] + row["hbm_s"] + row["comm_s"]
    head = (f"{row['devices']} devices, input: {_ms(row['input_time_s'])} ms per step per host "
            f"({row['input_examples_per_host']:,.0f} examples over {cores:g} cores) against a {_ms(device_s)} ms "
            "device step")
    if not row["input_binds"]:
        return f"{head}: keeps up ({needed:.1f} of the host's {cores:g} cores busy)"
    hosts = math.ceil(row["devices"] / devices_per_host)
    service = row["input_service_cores"]
    return (f"{head}: the step is bound by input; {math.ceil(needed)} cores per host would keep up, the host has "
            f"{cores:g}: {service} data-service worker cores per host ({service * hosts:,} for {hosts:,} host"
            f"{'s' if hosts > 1 else ''}; tf.data service workers on other machines) would lift the bound")


def write_json(plan: Dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan, f, indent=1, sort_keys=True)
        f.write("\n")
