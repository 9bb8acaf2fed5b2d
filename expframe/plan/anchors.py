"""The planner against published ResNet-50 measurements: the anchors, and the fit of the
device model's shared parameters to them.

    python -m expframe.plan.anchors              # the table (Markdown), as in docs/planning.md
    python -m expframe.plan.anchors --fit        # refit the parameters on the 'fitted' rows (JSON)
    python -m expframe.plan.anchors --measure    # re-measure the ResNet-50 footprint (TensorFlow, ~30 s)

Every row of anchors.json (each with its source and the software it ran on) is planned
with the planner's own model (`model.plan_row`) on the catalogue's device, with this
framework's ResNet-50 footprint (measured by `measure.py`, stored in anchors.json) and
per-device batch norm, as the published runs used. The parameters of hardware.json's
'efficiency' block marked fitted are those that minimise the sum of squared
log(predicted / published) over the rows marked 'fitted' (L-BFGS-B on the parameters
mapped into their bounds, a second or so). Rows marked 'repeat' publish a fitted row's
configuration again: shown, never fitted. The runs that check the model live in
heldout.json and are read by expframe/plan/validation.py only: `fit` refuses them.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from typing import Dict, Iterable, List, Optional

from expframe.plan import catalogue, model

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchors.json")
# The bounds of each fitted parameter's search.
BOUNDS = {"u_matrix": (0.05, 1.0), "tf32_ratio": (0.1, 1.0), "traffic_gpu": (0.0, 50.0), "traffic_fused": (0.0, 50.0),
          "traffic_tpu": (0.0, 50.0), "fill_gpu": (0.0, 200.0), "fill_tpu": (0.0, 200.0), "serial": (0.0, 1.0),
          "step_sync_s": (0.0, 0.05)}
FAMILIES = {"p100": "P100", "v100": "V100", "v100_32gb": "V100", "a100": "A100", "a100_40gb": "A100", "h100": "H100",
            "h200": "H100", "v2": "TPU v2", "v3": "TPU v3", "v4": "TPU v4", "v5e": "TPU v5e", "v5p": "TPU v5p"}
HELD_OUT = "_held_out"  # the mark validation.py puts on every row it reads from heldout.json


def load() -> dict:
    with open(_DATA, encoding="utf-8") as f:
        return json.load(f)


def experiment_footprint(data: Optional[dict] = None) -> model.Footprint:
    """This framework's ResNet-50 step as experiments/resnet50_imagenet_gpu.gin trains it
    (anchors.json holds its measured footprint): SyncBatchNorm over groups of one GPU, as
    it binds (each call's [channels, differentiated, group_size])."""
    stored = {k: v for k, v in (data or load())["footprint"].items() if not k.startswith("_")}
    return model.Footprint(**stored)


def footprint(data: Optional[dict] = None) -> model.Footprint:
    """The footprint the anchors are planned with: the experiment's ResNet-50 with
    per-device batch norm (no SyncBatchNorm collectives: every published run normalised
    per device or over a small group), compiled (XLA, or MXNet's fused kernels)."""
    return dataclasses.replace(experiment_footprint(data), sync_bn=[], sync_collectives=0, jit_compile=True)


def stacks(data: Optional[dict] = None) -> Dict[str, model.Stack]:
    """anchors.json's software, as the device model's stacks."""
    block = (data or load())["software"]
    return {name: model.Stack(name, entry["traffic"], bool(entry["step_sync"]))
            for name, entry in block.items() if not name.startswith("_")}


def family(row: Dict) -> str:
    """The device family a row belongs to ('A100' for both A100 cards)."""
    return FAMILIES.get(row["device"], row["device"])


def hardware(row: Dict, parameters: Optional[Dict[str, float]] = None) -> catalogue.Hardware:
    """The catalogue's device of a row, with the row's hosts (devices per host, network)."""
    hw = catalogue.published(row["device"])
    if parameters is not None:
        hw = dataclasses.replace(hw, efficiency={**hw.efficiency, **parameters})
    if "devices_per_host" in row:
        hw = dataclasses.replace(hw, devices_per_host=row["devices_per_host"])
    if "inter_host_gbps" in row:
        gbps = row["inter_host_gbps"]
        hw = dataclasses.replace(hw, inter_host=dataclasses.replace(hw.inter_host, name=f"{gbps:g} Gbit/s per host",
                                                                    bandwidth=gbps * 1e9 / 8))
    return hw


def predict(row: Dict, parameters: Optional[Dict[str, float]] = None, fp: Optional[model.Footprint] = None,
            software: Optional[Dict[str, model.Stack]] = None) -> Dict:
    """The planner's row for one published run (its examples/s beside the published images/s)."""
    fp = fp or footprint()
    stack = (software or stacks())[row["software"]]
    st = model.Settings(utilisation=None, precision=row["precision"], compiled=True, stack=stack)
    return model.plan_row(fp, hardware(row, parameters), row["devices"], row["global_batch"], st)


def fitted_names() -> List[str]:
    return list(catalogue.efficiency_priors())


def fitted_rows(data: Optional[dict] = None) -> List[Dict]:
    return [a for a in (data or load())["anchors"] if a["role"] == "fitted"]


def _to_unit(name: str, value: float) -> float:
    low, high = BOUNDS[name]
    return min(max((value - low) / (high - low), 0.0), 1.0)


def _from_unit(name: str, x: float) -> float:
    low, high = BOUNDS[name]
    return low + (high - low) * min(max(float(x), 0.0), 1.0)


def log_errors(rows: Iterable[Dict], parameters: Dict[str, float], data: Optional[dict] = None) -> List[float]:
    """log(predicted / published) per row."""
    data = data or load()
    fp, software = footprint(data), stacks(data)
    return [math.log(predict(a, parameters, fp, software)["examples_per_s"] / a["published"]) for a in rows]


def fit(rows: Optional[List[Dict]] = None, names: Optional[List[str]] = None, fixed: Optional[Dict[str, float]] = None,
        data: Optional[dict] = None) -> Dict[str, float]:
    """The parameters that minimise the sum of squared log(predicted / published) over `rows`
    (default: anchors.json's 'fitted' rows), starting from their priors.

    Args:
      rows: the rows to fit; a row read from heldout.json is refused (ValueError).
      names: the parameters to fit (default: every fitted parameter); the others are `fixed`.
      fixed: values of parameters not fitted (default: their priors).
      data: anchors.json's content (the footprint and the software).
    Returns:
      Every fitted parameter's value (the fixed ones included).
    """
    from scipy import optimize  # pylint: disable=import-outside-toplevel

    data = data or load()
    rows = fitted_rows(data) if rows is None else rows
    bad = [r["id"] for r in rows if r.get(HELD_OUT) or r.get("role") not in (None, "fitted")]
    if bad:
        raise ValueError(f"fit: {', '.join(bad)} are not fitted rows (held-out and repeated runs only check the model)")
    priors = catalogue.efficiency_priors()
    names = list(names if names is not None else priors)
    constant = {k: v for k, v in {**priors, **(fixed or {})}.items() if k not in names}
    fp, software = footprint(data), stacks(data)

    def loss(unit) -> float:
        parameters = {**constant, **{k: _from_unit(k, x) for k, x in zip(names, unit, strict=True)}}
        return sum(math.log(predict(a, parameters, fp, software)["examples_per_s"] / a["published"]) ** 2
                   for a in rows)

    # Each parameter scaled to its bounds, [0, 1]; L-BFGS-B with finite differences.
    bounds = [(0.0, 1.0)] * len(names)
    best = optimize.minimize(loss, [_to_unit(k, priors[k]) for k in names], method="L-BFGS-B", bounds=bounds)
    for _ in range(3):  # restart where it stopped: a search can stall where a bound flattens the loss
        again = optimize.minimize(loss, best.x, method="L-BFGS-B", bounds=bounds)
        if again.fun >= best.fun - 1e-9:
            break
        best = again
    return {**constant, **{k: _from_unit(k, x) for k, x in zip(names, best.x, strict=True)}}


def table(data: Optional[dict] = None, parameters: Optional[Dict[str, float]] = None,
          rows: Optional[List[Dict]] = None) -> List[Dict]:
    """One dict per row (default: anchors.json's): the published and predicted images/s,
    the error, the planner's step."""
    data = data or load()
    fp, software = footprint(data), stacks(data)
    out = []
    for a in (data["anchors"] if rows is None else rows):
        row = predict(a, parameters, fp, software)
        ratio = row["examples_per_s"] / a["published"]
        out.append({**a, "predicted": row["examples_per_s"], "ratio": ratio, "error": ratio - 1,
                    "per_replica_batch": row["per_replica_batch"], "bound": bound(row),
                    "utilisation": row["utilisation"]})
    return out


def bound(row: Dict) -> str:
    """The planner's step in shares: 'compute 60%, HBM 35%, comm 5%'."""
    parts = {"compute": row["compute_s"], "HBM": row["hbm_s"], "comm": row["comm_s"], "host": row["host_s"]}
    total = sum(parts.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items() if v / total >= 0.05)


def summary(rows: List[Dict]) -> Dict[str, float]:
    """Median absolute error over the fitted rows and the worst ratio either way."""
    fitted = [r for r in rows if r["role"] == "fitted"]
    return {"median_abs_error": statistics.median(abs(r["error"]) for r in fitted),
            "worst_ratio": max(max(r["ratio"], 1 / r["ratio"]) for r in fitted), "fitted": len(fitted),
            "repeats": sum(1 for r in rows if r["role"] == "repeat")}


def markdown(data: Optional[dict] = None) -> str:
    """The anchors table and its summary, as docs/planning.md holds them."""
    data = data or load()
    rows = table(data)
    s = summary(rows)
    lines = ["| anchor | configuration | software | published images/s | planner images/s | error | role "
             "| planner's step | source |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        role = f"repeat of `{r['repeats']}`" if r["role"] == "repeat" else r["role"]
        source = f"{r['source']}" + (f" at {r['revision']}" if r.get("revision") else "")
        lines.append(f"| `{r['id']}` | {r['what']} | {r['software']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['error']:+.0%} | {role} | {r['bound']}; util. {r['utilisation']:.0%} | "
                     f"{source}: {r['derivation']} |")
    lines += ["", f"Median absolute error **{s['median_abs_error']:.1%}** over the {s['fitted']} fitted rows; the "
              f"worst is off by {s['worst_ratio']:.2f}x. {s['repeats']} row(s) repeat a fitted configuration: shown, "
              "not fitted, not a check."]
    lines += ["", "Sources:", ""] + [f"- {key}: {text}" for key, text in data["sources"].items()]
    return "\n".join(lines)


def measure_footprint() -> Dict:
    """ResNet-50's footprint as anchors.json stores it (imports TensorFlow)."""
    from expframe import gin_paths  # pylint: disable=import-outside-toplevel
    from expframe.plan import measure  # pylint: disable=import-outside-toplevel
    files = [gin_paths.resolve("experiments/resnet50_imagenet_gpu.gin")]
    settings = measure.experiment_settings(files, [])
    fp, _ = measure.footprint(files, [], settings)
    keys = ("flops_fixed", "flops_per_example", "param_bytes", "grad_bytes", "slot_bytes", "activation_bytes_fixed",
            "activation_bytes_per_example", "num_params", "ops", "compiled_kernels", "sync_collectives",
            "all_reduce_bytes", "sync_bn", "jit_compile", "target")
    return {k: getattr(fp, k) for k in keys}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="refit the parameters on the 'fitted' rows; print JSON")
    parser.add_argument("--measure", action="store_true", help="re-measure ResNet-50's footprint; print JSON")
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_footprint(), indent=1))
    elif args.fit:
        print(json.dumps({k: round(v, 4) for k, v in fit().items()}, indent=1))
    else:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
