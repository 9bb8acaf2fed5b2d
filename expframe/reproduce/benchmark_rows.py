"""The figures each benchmark's JSON gives the results page: one row per figure, with its
goal (`expframe.reproduce.spread.Goal`) and its spread over repeats.

A row is `{"what", "value", "goal", "spread"}`: `goal` is a goal's JSON (`Goal.to_json`)
or None, `spread` a spread object (`spread.of`) or None. A row with a goal must carry
its spread: the page refuses it otherwise. Figures that are not timed (bytes) or timed
once (D4PG's rates, the mesh's examples/s) carry none and have no goal.

Runner ratios are the speed of expframe over the other runner's (above 1: expframe
ahead), judged against parity; collectives are a cost (all-reduce time / copy time,
lower is better), judged against `<= 3`.
"""

from __future__ import annotations

from typing import Optional

from expframe.reproduce import spread
from expframe.reproduce.spread import Goal


def row(what: str, value: float, goal: Optional[Goal] = None, spread_of: Optional[dict] = None) -> dict:
    """One figure of the page (see the module docstring)."""
    return {"what": what, "value": value, "goal": goal.to_json() if goal else None, "spread": spread_of}


def _spread(data: dict, name: str) -> Optional[dict]:
    """`data["spread"][name]` (None in JSON of a script from before spreads: the page
    refuses such a row when it has a goal)."""
    return (data.get("spread") or {}).get(name)


def collectives(data: dict) -> list[dict]:
    rows = []
    for run in data["runs"]:
        on_two = [r for r in run["results"] if r["replicas"] == 2]
        if not on_two:
            continue
        r = max(on_two, key=lambda r: r["size_bytes"])
        size = f"{r['size_bytes'] / 2**20:g} MB"
        for variant, ratio in sorted(r["ratio_to_copy_numpy"].items()):
            found = _spread(r, f"{variant}_over_copy_numpy")
            goal = spread.at_most(3.0) if variant == "replicator" and r["size_bytes"] == 64 * 2**20 else None
            rows.append(row(f"all-reduce ({variant}) of {size} on 2 replicas / one numpy copy, time (paired), "
                            f"allocator {run['allocator']}", found["median"] if found else ratio, goal, found))
    return rows


def runner_overhead(data: dict) -> list[dict]:
    return [row(f"expframe Trainer / hand-written loop, examples/s, {r['num_replicas']} replica(s) (paired)",
                r["median_paired_ratio"], spread.parity(data["goal_ratio"]), _spread(r, "expframe_over_handwritten"))
            for r in data["results"]]


def resnet50(data: dict) -> list[dict]:
    rows = []
    for r in data["results"]:
        where = f"{r['image_size']} px, {r['num_replicas']} replica(s), {r['precision']}"
        rows += [row(f"expframe / hand-written loop, images/s, {where} (paired)", r["expframe_over_handwritten_paired"],
                     spread.parity(), _spread(r, "expframe_over_handwritten")),
                 row(f"expframe / Keras fit, images/s, {where} (paired)", r["expframe_over_keras_fit_paired"],
                     spread.parity(), _spread(r, "expframe_over_keras_fit")),
                 row(f"expframe model FLOPs utilisation, {where}", r["expframe"]["mfu"], None,
                     _spread(r, "expframe_mfu"))]
    return rows


def fit_gap(data: dict) -> list[dict]:
    """benchmarks/fit_gap.py: each variant's speed over Keras fit's and over expframe's."""
    setup = data["setup"]
    where = f"{setup['size']} px, {setup['num_replicas']} replica(s), {setup['precision']}"
    rows = []
    for name, v in data["variants"].items():
        for other, label in (("keras_fit", "Keras fit"), ("expframe", "expframe")):
            found = v.get(f"over_{other}")
            if found:
                goal = spread.parity() if (name, other) == ("expframe", "keras_fit") else None
                rows.append(row(f"{name} / {label}, images/s, {where} (paired)", found["median"], goal, found))
    return rows


_OWN_PROCESS = {"keras_fit": "Keras fit in its own process (TensorFlow's threads and allocator)",
                "expframe_before": "expframe's process set-up before issue 61 (8 devices, 16 threads)",
                "keras_fit_xf": "Keras fit in a process set up as expframe's",
                "expframe_malloc": "expframe on TensorFlow's default allocator"}


def own_process(data: dict) -> list[dict]:
    """benchmarks/own_process.py: expframe's speed over each runner's, a process per runner."""
    rows = []
    for setting in data["settings"]:
        where = f"{setting['size']} px, {setting['replicas']} replica(s), {setting['precision']}"
        for name, v in setting["runners"].items():
            found = v.get("expframe_over")
            if found:
                goal = spread.parity() if name == "keras_fit" else None
                rows.append(row(f"expframe / {_OWN_PROCESS.get(name, name)}, images/s, {where} (paired)",
                                found["median"], goal, found))
    return rows


def scaling(data: dict) -> list[dict]:
    goal = spread.at_least(data["goal"])
    return [row("weak-scaling efficiency, 2 worker processes (multi_worker) / 2 x 1 (paired by repeat)",
                data["scaling_efficiency"]["multi_worker"], goal, _spread(data, "multi_worker")),
            row("weak-scaling efficiency, 2 local replicas (cpu) / 2 x 1 (paired by repeat)",
                data["scaling_efficiency"]["local_replicas"], goal, _spread(data, "local_replicas"))]


def data_checkpoint(data: dict) -> list[dict]:
    rows = []
    for r in data["rows"]:
        rows += [row(f"data position in the checkpoint, bytes, {r['num_replicas']} replica(s)", r["position_bytes"]),
                 row(f"tf.data iterator state / data position, {r['num_replicas']} replica(s)",
                     r["ratio_tfdata_over_position"])]
    return rows


def d4pg_throughput(data: dict) -> list[dict]:
    learner, actors = data["learner"], data["actors"]
    rows = []
    for n in ("1", "2"):
        rows += [row(f"learner updates/s, {n} replica(s)", learner[n]),
                 row(f"environment steps/s, {n} actor process(es)", actors[n]["env_steps_per_sec"]),
                 row(f"weight fetch, ms, {n} actor process(es)", actors[n]["weight_wait_ms_per_fetch"])]
    return rows + [row("learner updates/s, 2 replicas / 1", learner["2"] / learner["1"]),
                   row("environment steps/s, 2 actor processes / 1",
                       actors["2"]["env_steps_per_sec"] / actors["1"]["env_steps_per_sec"]),
                   row("time in weight fetches, 1 actor process (fraction)", actors["1"]["weight_wait_fraction"]),
                   row("time in weight fetches, 2 actor processes (fraction)", actors["2"]["weight_wait_fraction"])]


def model_parallel(data: dict) -> list[dict]:
    rows = []
    for r in data["rows"]:
        where = f"ViT width {r['width']}, mesh {r['mesh']}"
        rows += [row(f"{where}: parameter bytes per device", r["params_bytes"]),
                 row(f"{where}: Adam slot bytes per device", r["slot_bytes"]),
                 row(f"{where}: examples/s", r["examples_per_s"]),
                 row(f"{where}: examples/s / mesh 4x1", r["vs_4x1"])]
    return rows


def plan_vs_measured(data: dict) -> list[dict]:
    rows = [row(f"{e['name']}, {p['config']}: predicted / measured step time ({p['predicted_s'] * 1e3:.0f} / "
                f"{p['measured_s'] * 1e3:.0f} ms)", p["predicted_s"] / p["measured_s"])
            for e in data["experiments"] for p in e["points"]]
    return rows + [row("planner: median absolute error of the predicted step time (over the points)",
                       data["median_abs_error"], spread.at_most(data["goal"]), _spread(data, "median_abs_error"))]


def sync_batch_norm(data: dict) -> list[dict]:
    """benchmarks/sync_batch_norm.py: each design's step time over plain batch norm's, and
    shipped over the design before issue 59, per replica count; the variance's error."""
    rows = []
    for r in data["results"]:
        n, summary = r["replicas"], r["summary"]
        for name, found in summary.items():
            if name == "plain":
                continue
            rows.append(row(f"{name} / plain BatchNormalization, step time (paired), {n} replicas, "
                            f"ResNet-50's {r['layers']} batch norms", found["over_plain"]["median"], None,
                            found["over_plain"]))
        for a, b in (("shipped", "gather"), ("groups", "groups_whole")):
            found = summary.get(a, {}).get(f"over_{b}")
            if found:
                rows.append(row(f"{a} / {b}, step time (paired), {n} replicas", found["median"], None, found))
        for name, errors in (r.get("exactness") or {}).items():
            for case, value in errors.items():
                rows.append(row(f"{name}: variance error vs float64, mean 1e3 std 1, {case} shift, {n} replicas",
                                value))
    return rows


def imagenet_input(data: dict) -> list[dict]:
    """benchmarks/imagenet_input.py: each runner's images/s per core, the paired comparisons
    (shipped / standard recipe, 2 threads / 1) and the steps that make the shipped train
    pipeline slower (a variant without the step / with it); no goals."""
    rows = [row(f"{r['what']}, images/s per core, {r['threads']} thread(s)", r["per_core"]["median"], None,
                r["per_core"]) for r in data["runners"].values()]
    rows += [row(f"{c['what']} (paired)", c["spread"]["median"], None, c["spread"]) for c in data["comparisons"]]
    return rows + [row(f"why: {w['what']}, images/s (paired)", w["spread"]["median"], None, w["spread"])
                   for w in data["why"]]


def data_service_overhead(data: dict) -> list[dict]:
    """benchmarks/data_service_overhead.py: both runners' images/s, their paired ratio, and
    whether distributed_epoch repeated its order; no goals."""
    rows = [row(f"shipped ImageNet train pipeline, 1 thread, {name.replace('_', '-')}, images/s",
                r["images_per_sec"]["median"], None, r["images_per_sec"]) for name, r in data["runners"].items()]
    ratio = data["service_over_in_process"]
    rows.append(row("through one tf.data service shard / in-process, images/s (paired)", ratio["median"], None, ratio))
    modes = data["distributed_epoch"]
    rows.append(row(f"distributed_epoch over 2 workers, {modes['runs']} runs of {modes['elements']} elements: runs "
                    "in the same order (1 yes, 0 no)", float(modes["orders_equal"])))
    return rows
