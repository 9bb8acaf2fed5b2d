"""How far the device model carries beyond its fit: leave one device family out, the
held-out runs, and which rows pin each parameter.

    python -m expframe.plan.validation --leave_out=A100   # refit without one family, predict its rows
    python -m expframe.plan.validation --families          # every family in turn (docs/planning.md's table)
    python -m expframe.plan.validation --held_out          # the held-out runs (heldout.json)
    python -m expframe.plan.validation --parameters        # each parameter, its value, the rows that pin it
    python -m expframe.plan.validation --datasheet         # the H100 PCIe, from its datasheet alone

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

from expframe.plan import anchors, catalogue, datasheet, model

_HERE = os.path.dirname(os.path.abspath(__file__))
_HELD_OUT = os.path.join(_HERE, "heldout.json")
DATASHEET = os.path.join(_HERE, "datasheets", "h100_pcie.json")
# Published ResNet-50 runs of the device the shipped datasheet describes (not in the catalogue,
# never fitted), planned from the datasheet alone. Throughput from the MLPerf result logs as
# for anchors.json (block_start timestamps, median of the 5 runs).
DATASHEET_RUNS = [
    {"id": "mlperf30_supermicro_8_h100_pcie", "devices": 8, "global_batch": 3200, "precision": "mixed_float16",
     "software": "mxnet_mlperf", "published": 35565,
     "what": "MLPerf v3.0, Supermicro AS-4125GS-TNRT, 8 H100 PCIe 80 GB (PCIe Gen5), MXNet, float16, 400 per GPU",
     "source": "mlcommons/training_results_v3.0, Supermicro/results/AS-4125GS-TNRT_8_H100-PCIe-80GB: 35,565 images/s "
               "(5 runs 35,536-35,568)"},
    {"id": "mlperf30_dell_4_h100_pcie", "devices": 4, "global_batch": 3264, "precision": "mixed_float16",
     "software": "mxnet_mlperf", "published": 18828,
     "what": "MLPerf v3.0, Dell R760xa, 4 H100 PCIe 80 GB, MXNet 23.04, float16, 816 per GPU",
     "source": "mlcommons/training_results_v3.0, Dell/results/R760xax4H100-PCIE-80GB: 18,828 images/s "
               "(5 runs 18,823-18,840)"},
]
LEFT_OUT = ("P100", "V100", "A100", "H100", "TPU v3", "TPU v4")
PINNED = 0.01  # a row depends on a parameter when its log prediction moves by this much per unit log parameter


def load_held_out() -> dict:
    """heldout.json, each run marked held out (`anchors.fit` refuses marked rows)."""
    with open(_HELD_OUT, encoding="utf-8") as f:
        data = json.load(f)
    data["runs"] = [{**run, anchors.HELD_OUT: True, "role": "repeat" if "repeats" in run else "held out"}
                    for run in data["runs"]]
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
    """Counts over the held-out runs (a run that repeats an anchors.json configuration is not one)."""
    rows = [r for r in rows if r["role"] == "held out"]
    off = [max(r["ratio"], 1 / r["ratio"]) for r in rows]
    return {"runs": len(rows), "within_1_2": sum(1 for x in off if x <= 1.2),
            "within_1_5": sum(1 for x in off if x <= 1.5),
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows), "worst_ratio": max(off),
            "devices": (min(r["devices"] for r in rows), max(r["devices"] for r in rows)),
            "precisions": sorted({catalogue.published(r["device"]).peak_key(r["precision"]) for r in rows}),
            "families": sorted({anchors.family(r) for r in rows})}


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
                    "rows": sum(1 for _, s in ranked if abs(s) >= PINNED),
                    "top": [(row, s) for row, s in ranked[:3] if abs(s) >= PINNED]})
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
        repeat = f" **Not counted**: repeats `{r['repeats']}`; {r['note']}." if r["role"] == "repeat" else ""
        lines.append(f"| `{r['id']}` | {r['what']} | {r['software']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['ratio']:.2f}x | {r['source']}: {r['derivation']}.{repeat} |")
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


def datasheet_rows(path: str = DATASHEET) -> List[Dict]:
    """DATASHEET_RUNS planned on the device `path` describes, with the shared parameters alone."""
    data = anchors.load()
    hw, fp, software = datasheet.load(path), anchors.footprint(data), anchors.stacks(data)
    out = []
    for run in DATASHEET_RUNS:
        st = model.Settings(utilisation=None, precision=run["precision"], compiled=True,
                            stack=software[run["software"]])
        row = model.plan_row(fp, hw, run["devices"], run["global_batch"], st)
        out.append({**run, "predicted": row["examples_per_s"], "ratio": row["examples_per_s"] / run["published"],
                    "bound": anchors.bound(row)})
    return out


def markdown_datasheet(path: str = DATASHEET) -> str:
    """docs/planning.md's datasheet example: the planned H100 PCIe beside its published runs."""
    lines = ["| run | configuration | published images/s | planner images/s | planned / published | planner's step "
             "| source |", "|---|---|---|---|---|---|---|"]
    for r in datasheet_rows(path):
        lines.append(f"| `{r['id']}` | {r['what']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['ratio']:.2f}x | {r['bound']} | {r['source']} |")
    return "\n".join(lines)


BALANCE_ROWS = ("ngc_v100_1_fp32", "ngc_v100_1_amp", "ngc_a100_1_tf32", "ngc_a100_1_amp", "mlperf30_dgxh100",
                "mlperf06_v3_32", "mlperf10_v4_128")


def markdown_balance() -> str:
    """Why devices reach the fractions of peak they do: each one's balance, its bound roof,
    the fraction of peak planned and published (one fitted row per device and precision)."""
    data = anchors.load()
    fp, software = anchors.footprint(data), anchors.stacks(data)
    by_id = {r["id"]: r for r in data["anchors"]}
    lines = ["| row | device, math unit | peak / HBM bandwidth (FLOP per byte) | bound by | of peak: planned | "
             "published |", "|---|---|---|---|---|---|"]
    for key in BALANCE_ROWS:
        r = by_id[key]
        hw = catalogue.published(r["device"])
        row = anchors.predict(r, None, fp, software)
        cores = max(1, hw.cores_per_chip)
        b = row["per_replica_batch"]
        published = r["published"] / row["replicas"] * fp.flops(b) / b / (hw.peak(r["precision"]) / cores)
        unit = f"{hw.peak_key(r['precision'])} on {hw.efficiency_key(r['precision'])}"
        lines.append(f"| `{key}` | {hw.name}, {unit} | {hw.peak(r['precision']) / hw.memory_bandwidth:.0f} | "
                     f"{'memory' if row['hbm_s'] > row['compute_s'] else 'compute'} | {row['utilisation']:.0%} | "
                     f"{published:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leave_out", help=f"refit without one family ({', '.join(LEFT_OUT)}) and predict its rows")
    parser.add_argument("--families", action="store_true", help="leave each family out in turn (Markdown)")
    parser.add_argument("--held_out", action="store_true", help="the held-out runs (Markdown)")
    parser.add_argument("--parameters", action="store_true", help="the parameters and the rows that pin them")
    parser.add_argument("--datasheet", action="store_true", help="the H100 PCIe planned from its datasheet alone")
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
                  f"{r['ratio']:.2f}x  {'left out' if r['role'] == 'fitted' else r['role']}")
    elif args.families:
        print(markdown_families())
    elif args.held_out:
        print(markdown_held_out())
    elif args.parameters:
        print(markdown_parameters())
        print()
        print(markdown_balance())
    elif args.datasheet:
        print(markdown_datasheet())
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

