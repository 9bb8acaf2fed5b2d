"""How far the device model carries beyond its fit: leave one device family out, the
held-out runs, and which rows pin each parameter.

    python -m expframe.plan.validation --leave_out=A100   # refit without one family, predict its rows
    python -m expframe.plan.validation --families          # every family in turn (docs/planning.md's table)
    python -m expframe.plan.validation --held_out          # the held-out runs (heldout.json)
    python -m expframe.plan.validation --parameters        # each parameter, its value, the rows that pin it

Leave one family out: the fit of `anchors.fit` on every fitted row but one family's
(P100, V100, A100, H100, TPU v3, TPU v4), each parameter that no remaining row depends
on held at its prior (hardware.json 'efficiency' 'prior': TF32's ratio without the
A100 rows), then the family's rows predicted. A row that repeats a fitted configuration
is predicted with its family and marked a repeat.

The held-out runs (heldout.json) were chosen before the model was fitted and are read
here only: each row read is marked (`anchors.HELD_OUT`) and `anchors.fit` refuses such
rows, so a run that checks the model never tunes it. Plain Python (and scipy's
optimiser, through anchors.fit).
"""

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional

from expframe.plan import anchors, catalogue, model

_HELD_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout.json")
LEFT_OUT = ("P100", "V100", "A100", "H100", "TPU v3", "TPU v4")
PINNED = 0.01  # a row depends on a parameter when its log prediction moves by this much per unit log parameter


def load_held_out() -> dict:
    """heldout.json, each run marked held out (`anchors.fit` refuses marked rows)."""
    with open(_HELD_OUT, encoding="utf-8") as f:
        data = json.load(f)
    data["runs"] = [{**run, anchors.HELD_OUT: True, "role": "held out"} for run in data["runs"]]
    return data


def sensitivities(rows: List[Dict], parameters: Dict[str, float], data: Optional[dict] = None,
                  step: float = 0.01) -> Dict[str, Dict[str, float]]:
    """d log(predicted) / d log(parameter) per fitted parameter and row (central differences)."""
    data = data or anchors.load()
    out = {}
    for name in anchors.fitted_names():
        value = parameters[name]
        delta = step * value if value else step * (anchors.BOUNDS[name][1] - anchors.BOUNDS[name][0])
        up = anchors.log_errors(rows, {**parameters, name: value + delta}, data)
        down = anchors.log_errors(rows, {**parameters, name: max(0.0, value - delta)}, data)
        scale = 2 * delta / value if value else 2 * delta / (anchors.BOUNDS[name][1] - anchors.BOUNDS[name][0])
        out[name] = {r["id"]: (u - d) / scale for r, u, d in zip(rows, up, down, strict=True)}
    return out


def leave_out(name: str, data: Optional[dict] = None) -> Dict:
    """Refit without family `name`'s rows; predict them. Returns {'family', 'parameters',
    'at_prior' (the parameters no remaining row pins), 'rows' (anchors.table's, refitted)}."""
    data = data or anchors.load()
    fitted = anchors.fitted_rows(data)
    train = [r for r in fitted if anchors.family(r) != name]
    if len(train) == len(fitted):
        raise ValueError(f"--leave_out={name!r}: no fitted row of that family; families: {', '.join(LEFT_OUT)}")
    priors = catalogue.efficiency_priors()
    pins = sensitivities(train, priors, data)
    names = [k for k in anchors.fitted_names() if max(abs(s) for s in pins[k].values()) >= PINNED]
    parameters = anchors.fit(train, names, data=data)
    # Re-check at the refitted values: a parameter pinned only at its prior is not pinned.
    pins = sensitivities(train, parameters, data)
    at_prior = [k for k in anchors.fitted_names() if max(abs(s) for s in pins[k].values()) < PINNED]
    if at_prior:
        parameters = anchors.fit(train, [k for k in anchors.fitted_names() if k not in at_prior], data=data)
    rows = [r for r in data["anchors"] if anchors.family(r) == name]
    return {"family": name, "parameters": parameters, "at_prior": at_prior,
            "rows": anchors.table(data, parameters, rows)}


def families(data: Optional[dict] = None) -> List[Dict]:
    """`leave_out` for each of LEFT_OUT."""
    data = data or anchors.load()
    return [leave_out(name, data) for name in LEFT_OUT]


def held_out(parameters: Optional[Dict[str, float]] = None) -> List[Dict]:
    """The held-out runs beside the planner's prediction with the stored (or given) parameters."""
    return anchors.table(anchors.load(), parameters, load_held_out()["runs"])


def held_out_summary(rows: List[Dict]) -> Dict:
    off = [max(r["ratio"], 1 / r["ratio"]) for r in rows]
    return {"runs": len(rows), "within_1_2": sum(1 for x in off if x <= 1.2),
            "within_1_5": sum(1 for x in off if x <= 1.5),
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows), "worst_ratio": max(off),
            "devices": (min(r["devices"] for r in rows), max(r["devices"] for r in rows)),
            "precisions": sorted({r["precision"] for r in rows}), "families": sorted({anchors.family(r) for r in rows})}


def weak_scaling(device: str = "a100", per_gpu: int = 256, devices: int = 8, precision: str = "mixed_float16") -> float:
    """The planner's weak scaling of this framework's ResNet-50 (per-device batch norm) from
    1 to `devices` GPUs of one host at `per_gpu` images per GPU."""
    fp, hw = anchors.footprint(), catalogue.published(device)
    st = model.Settings(utilisation=None, precision=precision)
    rows = [model.plan_row(fp, hw, n, per_gpu * n, st) for n in (1, devices)]
    model.add_efficiency(rows, fp, hw, st)
    return rows[1]["weak_efficiency"]


def pins_table(data: Optional[dict] = None) -> List[Dict]:
    """Per fitted parameter: its value, prior and the fitted rows that depend on it most."""
    data = data or anchors.load()
    parameters = catalogue.efficiency_parameters()
    rows = anchors.fitted_rows(data)
    pins = sensitivities(rows, parameters, data)
    out = []
    for name in anchors.fitted_names():
        ranked = sorted(pins[name].items(), key=lambda item: -abs(item[1]))
        out.append({"name": name, "value": parameters[name], "prior": catalogue.efficiency_priors()[name],
                    "rows": sum(1 for _, s in ranked if abs(s) >= PINNED), "top": ranked[:3]})
    return out


def _ratios(rows: List[Dict]) -> str:
    return ", ".join(f"`{r['id']}` {r['ratio']:.2f}x" + (" (repeat)" if r["role"] == "repeat" else "") for r in rows)


def markdown_families(results: Optional[List[Dict]] = None) -> str:
    """docs/planning.md's leave-one-family-out table."""
    results = results if results is not None else families()
    lines = ["| family left out | its rows: planned / published | range | parameters at their prior |",
             "|---|---|---|---|"]
    for res in results:
        ratios = [r["ratio"] for r in res["rows"] if r["role"] == "fitted"]
        lines.append(f"| {res['family']} | {_ratios(res['rows'])} | {min(ratios):.2f}-{max(ratios):.2f}x | "
                     f"{', '.join(res['at_prior']) or 'none'} |")
    worst = max(max(r["ratio"], 1 / r["ratio"]) for res in results for r in res["rows"] if r["role"] == "fitted")
    lines += ["", f"Every family within **{worst:.2f}x** of its published rows when left out of the fit."]
    return "\n".join(lines)


def markdown_held_out(rows: Optional[List[Dict]] = None) -> str:
    """docs/planning.md's held-out table."""
    rows = rows if rows is not None else held_out()
    data = load_held_out()
    s = held_out_summary(rows)
    lines = ["| run | configuration | software | published images/s | planner images/s | planned / published | "
             "source |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['id']}` | {r['what']} | {r['software']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['ratio']:.2f}x | {r['source']}: {r['derivation']} |")
    lines += ["", f"{s['runs']} runs ({', '.join(s['families'])}; {', '.join(s['precisions'])}; {s['devices'][0]} to "
              f"{s['devices'][1]:,} devices): **{s['within_1_2']}** within 1.2x, **{s['within_1_5']}** within 1.5x; "
              f"median absolute error {s['median_abs_error']:.1%}, the worst {s['worst_ratio']:.2f}x."]
    lines += ["", "Sources:", ""] + [f"- {key}: {text}" for key, text in data["sources"].items()]
    return "\n".join(lines)


def markdown_parameters() -> str:
    """docs/planning.md's table of the parameters: value, prior, the rows that pin each."""
    table = pins_table()
    stated = {k: v for k, v in catalogue.efficiency_parameters().items() if k not in anchors.fitted_names()}
    lines = ["| parameter | fitted value | prior | rows that depend on it | most (d log planned / d log parameter) |",
             "|---|---|---|---|---|"]
    for p in table:
        top = ", ".join(f"`{row}` {s:+.2f}" for row, s in p["top"])
        lines.append(f"| `{p['name']}` | {p['value']:.4g} | {p['prior']:g} | {p['rows']} | {top} |")
    rows = len(anchors.fitted_rows())
    lines += ["", f"{len(table)} fitted parameters, {rows} fitted rows; stated (not fitted): "
              + ", ".join(f"`{k}` = {v:g}" for k, v in stated.items()) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leave_out", help=f"refit without one family ({', '.join(LEFT_OUT)}) and predict its rows")
    parser.add_argument("--families", action="store_true", help="leave each family out in turn (Markdown)")
    parser.add_argument("--held_out", action="store_true", help="the held-out runs (Markdown)")
    parser.add_argument("--parameters", action="store_true", help="the parameters and the rows that pin them")
    args = parser.parse_args(argv)
    if args.leave_out:
        try:
            res = leave_out(args.leave_out)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({k: round(v, 4) for k, v in res["parameters"].items()}, indent=1))
        print(f"at their prior: {', '.join(res['at_prior']) or 'none'}")
        for r in res["rows"]:
            print(f"{r['id']:24s} published {r['published']:>12,.0f}  planned {r['predicted']:>12,.0f}  "
                  f"{r['ratio']:.2f}x  {r['role']}")
    elif args.families:
        print(markdown_families())
    elif args.held_out:
        print(markdown_held_out())
    elif args.parameters:
        print(markdown_parameters())
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

