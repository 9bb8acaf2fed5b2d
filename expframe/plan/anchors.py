"""The planner against published ResNet-50 measurements: the anchors table, and the fit of
the device model's parameters.

    python -m expframe.plan.anchors              # the table (Markdown), as in docs/planning.md
    python -m expframe.plan.anchors --fit        # refit the parameters on the 'fitted' rows (JSON)
    python -m expframe.plan.anchors --measure    # re-measure the ResNet-50 footprint (TensorFlow, ~30 s)

Every row of anchors.json (each with its source) is planned with the planner's own model
(`model.plan_row`) on the catalogue's device, with this framework's ResNet-50 footprint
(measured by `measure.py`, stored in anchors.json) and per-device batch norm, as the
published runs used. The parameters of `hardware.json`'s 'efficiency' block marked
fitted are those that minimise the sum of squared log(predicted / published) over the
rows marked 'fitted' (a Nelder-Mead search, plain Python, a second or so); the rows
marked 'held out' only check them. Plain Python: no TensorFlow unless --measure.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence

from expframe.plan import catalogue, model

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchors.json")
# The bounds of each fitted parameter's search (a compute efficiency is in (0, 1]).
_BOUNDS = {"traffic_gpu": (0.0, 50.0), "traffic_tpu": (0.0, 50.0), "fill_batch_gpu": (0.0, 200.0),
           "fill_batch_tpu": (0.0, 200.0)}


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


def hardware(anchor: Dict, parameters: Optional[Dict[str, float]] = None) -> catalogue.Hardware:
    hw = catalogue.published(anchor["device"])
    if parameters is not None:
        hw = dataclasses.replace(hw, efficiency={**hw.efficiency, **parameters})
    if "devices_per_host" in anchor:
        hw = dataclasses.replace(hw, devices_per_host=anchor["devices_per_host"])
    return hw


def predict(anchor: Dict, parameters: Optional[Dict[str, float]] = None, fp: Optional[model.Footprint] = None) -> Dict:
    """The planner's row for one anchor (its examples/s beside the published images/s)."""
    fp = fp or footprint()
    st = model.Settings(utilisation=None, precision=anchor["precision"], compiled=True)
    return model.plan_row(fp, hardware(anchor, parameters), anchor["devices"], anchor["global_batch"], st)


def fitted_names(data: Optional[dict] = None) -> List[str]:
    hw = catalogue._load()  # noqa: SLF001  (the catalogue's own file)
    del data
    return list(hw["efficiency"]["fitted"])


def _to_free(name: str, value: float) -> float:
    low, high = _BOUNDS.get(name, (0.0, 1.0))
    p = min(max((value - low) / (high - low), 1e-9), 1 - 1e-9)
    return math.log(p / (1 - p))


def _from_free(name: str, x: float) -> float:
    low, high = _BOUNDS.get(name, (0.0, 1.0))
    return low + (high - low) / (1 + math.exp(-x))


def nelder_mead(f: Callable[[List[float]], float], x0: Sequence[float], step: float = 0.5, tolerance: float = 1e-12,
                max_evaluations: int = 20000) -> List[float]:
    """Minimises f from x0 (Nelder and Mead 1965, standard coefficients)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    evaluations = n + 1
    while evaluations < max_evaluations:
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centre = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centre, worst, strict=True)]
        fr = f(reflected)
        evaluations += 1
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst, strict=True)]
            fe = f(expanded)
            evaluations += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst, strict=True)]
            fc = f(contracted)
            evaluations += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (p - b) for b, p in zip(best, point, strict=True)]
                                    for point in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
                evaluations += n
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(data: Optional[dict] = None, start: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """The fitted parameters: least squares in log(predicted / published) over the 'fitted' rows."""
    data = data or load()
    fp = footprint(data)
    rows = [a for a in data["anchors"] if a["role"] == "fitted"]
    names = fitted_names()
    start = start or {k: v for k, v in catalogue.efficiency_parameters().items() if k in names}

    def loss(free: List[float]) -> float:
        parameters = {k: _from_free(k, x) for k, x in zip(names, free, strict=True)}
        return sum(math.log(predict(a, parameters, fp)["examples_per_s"] / a["published"]) ** 2 for a in rows)

    best = [_to_free(k, start[k]) for k in names]
    for _ in range(3):  # restarts from the best point: Nelder-Mead can stall on a ridge
        best = nelder_mead(loss, best)
    return {k: _from_free(k, x) for k, x in zip(names, best, strict=True)}


def table(data: Optional[dict] = None, parameters: Optional[Dict[str, float]] = None) -> List[Dict]:
    """One dict per anchor: the published and predicted images/s, the error, its role."""
    data = data or load()
    fp = footprint(data)
    out = []
    for a in data["anchors"]:
        row = predict(a, parameters, fp)
        ratio = row["examples_per_s"] / a["published"]
        out.append({**a, "predicted": row["examples_per_s"], "ratio": ratio, "error": ratio - 1,
                    "per_replica_batch": row["per_replica_batch"], "bound": _bound(row),
                    "utilisation": row["utilisation"]})
    return out


def _bound(row: Dict) -> str:
    parts = {"compute": row["compute_s"], "HBM": row["hbm_s"], "comm": row["comm_s"], "host": row["host_s"]}
    total = sum(parts.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items() if v / total >= 0.05)


def summary(rows: List[Dict]) -> Dict[str, float]:
    """Median absolute error (all, fitted, held out) and the worst ratio either way."""
    def median(role=None):
        errors = [abs(r["error"]) for r in rows if role is None or r["role"] == role]
        return statistics.median(errors) if errors else float("nan")
    return {"median_abs_error": median(), "fitted_median_abs_error": median("fitted"),
            "held_out_median_abs_error": median("held out"),
            "worst_ratio": max(max(r["ratio"], 1 / r["ratio"]) for r in rows),
            "held_out": sum(1 for r in rows if r["role"] == "held out"),
            "held_out_devices": len({r["device"].split("_")[0] for r in rows if r["role"] == "held out"}),
            "fitted": sum(1 for r in rows if r["role"] == "fitted")}


def markdown(data: Optional[dict] = None) -> str:
    """The anchors table and its summary, as docs/planning.md holds them."""
    data = data or load()
    rows = table(data)
    s = summary(rows)
    parameters = catalogue.efficiency_parameters()
    lines = ["| anchor | configuration | published images/s | planner images/s | error | role | planner's step "
             "| source |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['id']}` | {r['what']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['error']:+.0%} | {r['role']} | {r['bound']}; util. {r['utilisation']:.0%} | "
                     f"{r['source']}: {r['derivation']} |")
    names = fitted_names()
    fitted = ", ".join(f"{k} = {parameters[k]:.3g}" for k in names)
    stated = [k for k in parameters if k not in names]
    lines += ["", f"Median absolute error **{s['median_abs_error']:.1%}** over all {len(rows)} rows; "
              f"**{s['fitted_median_abs_error']:.1%}** over the {s['fitted']} fitted rows and "
              f"**{s['held_out_median_abs_error']:.1%}** over the {s['held_out']} held-out rows "
              f"({s['held_out_devices']} device families); the worst row is off by "
              f"{s['worst_ratio']:.2f}x. Fitted ({len(names)} parameters, hardware.json 'efficiency'): {fitted}"
              + (f"; stated: {', '.join(f'{k} = {parameters[k]:.3g}' for k in stated)}." if stated else ".")]
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
