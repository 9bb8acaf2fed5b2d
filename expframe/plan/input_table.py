"""The cores it takes to feed each device: docs/planning.md's input tables, generated.

    python -m expframe.plan.input_table     # both tables, Markdown, as docs/planning.md holds them

Every catalogue device, one host full of them, runs this framework's ResNet-50 step
(anchors.json's footprint: per-device batch norm, compiled by XLA, TensorFlow's stack) at
the precision 'auto' picks (bfloat16 on a TPU, an A100, H100 or H200; float16 on a V100 or
P100) and 128 images per replica (experiments/resnet50_imagenet_gpu.gin's 128 per GPU; a
TPU v2/v3 chip holds 2 replicas). For each: the images/s per device the devices alone
would reach, the CPU cores per device that keep its input within the device step at the
measured per-core rate (input_rate.json, host_core_factor 1), the cores its reference
host has per device (hardware.json host_cpu), and the images/s per device with the
host's input charged (input_bound.py). The second table takes the published rate of
single-system runs the device model was fitted on (anchors.json) and asks the same of it:
the cores that rate would need, against the host's. Plain Python.
"""

import argparse
import dataclasses
import sys
from typing import Dict, List, Optional

from expframe.plan import anchors, catalogue, input_rate, model, planner

PER_REPLICA = 128
# Catalogue devices in the table's order (every one: tests/plan/test_input_bound.py checks).
ORDER = ("p100", "v100", "v100_32gb", "a100_40gb", "a100", "h100", "h200", "v2", "v3", "v4", "v5e", "v5p")
# Published runs on one reference host (or one slice of TPU hosts), as anchors.json holds them.
PUBLISHED = ("ngc_v100_8_amp", "mlperf06_dgx1", "ngc_a100_8_amp", "mlperf10_dgxa100", "mlperf30_dgxh100",
             "mlperf06_v3_32", "mlperf10_v4_128")


def _fed(st: model.Settings, rate: input_rate.InputRate, factor: float) -> model.Settings:
    """`st` with the host's input charged at `rate` x `factor` per core."""
    return dataclasses.replace(st, input_core_s_per_example=1.0 / (rate.images_per_sec_per_core * factor))


def device_rows(rate: Optional[input_rate.InputRate] = None, factor: float = 1.0) -> List[Dict]:
    """One row per catalogue device: one host of it, this framework's ResNet-50 step."""
    rate = rate or input_rate.load()
    fp = anchors.footprint()
    out = []
    for name in ORDER:
        hw = catalogue.published(name)
        n = hw.devices_per_host
        batch = PER_REPLICA * n * max(1, hw.cores_per_chip)
        st = model.Settings(None, planner.resolve_precision("auto", hw))
        alone = model.plan_row(fp, hw, n, batch, st)
        fed = model.plan_row(fp, hw, n, batch, _fed(st, rate, factor))
        out.append({"device": name, "host_cpu": hw.host_cpu, "precision": st.precision, "devices": n,
                    "alone_per_device": alone["examples_per_s"] / n, "fed_per_device": fed["examples_per_s"] / n,
                    "cores_needed_per_device": fed["input_cores_needed"] / n,
                    "host_cores_per_device": hw.host_cores_per_device, "binds": fed["input_binds"],
                    "bottleneck": fed["bottleneck"]})
    return out


def published_rows(rate: Optional[input_rate.InputRate] = None, factor: float = 1.0) -> List[Dict]:
    """PUBLISHED's runs: the cores their published rate needs against the host's, and the
    planner's rate for them (their software's traffic) alone and with the host's input."""
    rate = rate or input_rate.load()
    data = anchors.load()
    by_id, fp, software = {r["id"]: r for r in data["anchors"]}, anchors.footprint(data), anchors.stacks(data)
    out = []
    for key in PUBLISHED:
        r = by_id[key]
        hw = anchors.hardware(r)
        st = model.Settings(None, r["precision"], compiled=True, stack=software[r["software"]])
        alone = model.plan_row(fp, hw, r["devices"], r["global_batch"], st)
        fed = model.plan_row(fp, hw, r["devices"], r["global_batch"], _fed(st, rate, factor))
        per_device = r["published"] / r["devices"]
        needed = per_device / (rate.images_per_sec_per_core * factor)
        out.append({"id": key, "what": r["what"], "published_per_device": per_device, "cores_needed": needed,
                    "host_cores_per_device": hw.host_cores_per_device,
                    "alone_per_device": alone["examples_per_s"] / r["devices"],
                    "fed_per_device": fed["examples_per_s"] / r["devices"], "binds": fed["input_binds"]})
    return out


def _verdict(needed: float, have: float) -> str:
    if needed <= have:
        return f"keeps up ({needed / have:.0%} of the host's cores)"
    return f"**binds**: {needed - have:.1f} more cores per device"


def markdown(rate: Optional[input_rate.InputRate] = None) -> str:
    """docs/planning.md's two input tables and their summary lines."""
    rate = rate or input_rate.load()
    r = f"{rate.images_per_sec_per_core:,.0f}"
    rows = device_rows(rate)
    lines = [f"| device | reference host (CPU) | precision | images/s per device, devices alone | cores per device "
             f"to keep up at {r} images/s per core | host cores per device | input | images/s per device with the "
             "host's input | bound by |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['device']} | {row['host_cpu']} | {row['precision']} | {row['alone_per_device']:,.0f} | "
                     f"{row['cores_needed_per_device']:.1f} | {row['host_cores_per_device']:g} | "
                     f"{_verdict(row['cores_needed_per_device'], row['host_cores_per_device'])} | "
                     f"{row['fed_per_device']:,.0f} | {row['bottleneck']} |")
    binding = [row["device"] for row in rows if row["binds"]]
    lines += ["", f"At {r} images/s per core the input binds on {len(binding)} of the {len(rows)} devices ("
              + (", ".join(binding) if binding else "it keeps up on every one") + ")."]
    pub = published_rows(rate)
    lines += ["", f"| run | published images/s per device | cores per device to keep up at {r} images/s per core | "
              "host cores per device | input at the published rate | planner images/s per device: devices alone, "
              "with the host's input |", "|---|---|---|---|---|---|"]
    for row in pub:
        lines.append(f"| `{row['id']}` ({row['what']}) | {row['published_per_device']:,.0f} | "
                     f"{row['cores_needed']:.1f} | {row['host_cores_per_device']:g} | "
                     f"{_verdict(row['cores_needed'], row['host_cores_per_device'])} | "
                     f"{row['alone_per_device']:,.0f}, {row['fed_per_device']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
