"""The GPU check: one table of what a session with a GPU must measure, in under 8 minutes.

    python benchmarks/gpu_check.py                        # one GPU (the 'gpu' target), < 8 minutes
    python benchmarks/gpu_check.py --target=cpu --tiny    # the same logic on this CPU at tiny sizes (tests)

One markdown table (stdout, and `--markdown`), JSON in benchmarks/results/gpu_check.json,
written after every row so that a run stopped early keeps what it measured:

  auto      what `run_experiment.precision = 'auto'` and `Replicator.jit_compile =
            'auto'` choose on this device, with the probes' speed ratios.
  resnet    ResNet-50 training images/s (224x224, synthetic data, SGD + momentum)
            for expframe (`Replicator` + `Trainer`), the hand-written loop
            (benchmarks/handwritten.py) and Keras `fit`, at float32 and mixed_float16,
            each with XLA off and on (`Replicator.jit_compile`, the loop's
            `tf.function(jit_compile=True)`, `compile(jit_compile=...)`); the note
            says which of the two Keras' own default (`jit_compile='auto'`) is here.
            Keras fit runs without a strategy, as a one-device user writes it;
            expframe and the loop on the target's strategy. Timed interleaved
            (benchmarks/resnet50_throughput.py), median images/s.
  matrix    the conformance matrix (every task x precision) on the target, from the
            matrix's own entry point (`--matrix`, default
            `tests.conformance.matrix:run_target`, `run_target(target) ->
            [{"combination", "result", "agreement"}, ...]`), in a subprocess with the
            time left; "not available" if that function does not exist.
  d4pg      D4PG learner steps/s: main.py on experiments/d4pg_control.gin on the
            target, 1 replica, float32 (benchmarks/d4pg_throughput.py's learner run).

Time budget (`--budget_s`, default 450 s): the ResNet configurations start only while
the time they are expected to take (the slowest so far) fits before the time kept
for the matrix and D4PG; the rest are reported as skipped. Expected on one recent
GPU: about 60-90 s per ResNet configuration (three models built, traced and, with
XLA, compiled), 1-3 minutes for the matrix, under a minute for D4PG.
"""

import argparse
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, _HERE)

import tensorflow as tf  # noqa: E402

import d4pg_throughput  # noqa: E402  (benchmarks/d4pg_throughput.py)
import resnet50_throughput as r50  # noqa: E402  (benchmarks/resnet50_throughput.py; splits the CPU in 2)
from expframe import processes  # noqa: E402
from expframe.replicator import auto_settings, autotune, probes  # noqa: E402
from machine import write_result  # noqa: E402  (benchmarks/machine.py)

RESULTS = os.path.join(_HERE, "results", "gpu_check.json")
DEFAULT_MATRIX = "tests.conformance.matrix:run_target"
RUNNERS = ("expframe", "handwritten", "keras_fit")
COLUMNS = ("section", "configuration", "expframe", "handwritten", "keras fit", "note")
FULL = dict(size=224, depth=50, global_batch=128, steps=10, repeats=3, d4pg_steps=600, d4pg_params=())
TINY = dict(size=16, depth=8, global_batch=2, steps=1, repeats=1, d4pg_steps=20,
            d4pg_params=("Trainer.global_batch_size = 16", "D4PGTask.min_replay_size = 64"))
# Seconds kept for the sections after the ResNet one.
RESERVE_S = {"matrix": 180.0, "d4pg": 75.0}


def should_start(durations: Sequence[float], now: float, deadline: float) -> bool:
    """Start another configuration if none ran yet, or if the slowest so far still fits."""
    return not durations or now + max(durations) <= deadline


def device_description(target: str) -> str:
    device = auto_settings.probe_device(target)
    return f"{probes.device_model(device)}, TensorFlow {tf.__version__}"


# -- sections -------------------------------------------------------------------------------

def auto_rows(target: str) -> List[Dict]:
    """What 'auto' picks on this device (measured now if not cached), as table rows."""
    precision = auto_settings.precision_choice(target)
    import keras  # pylint: disable=import-outside-toplevel
    rows = [{"section": "auto", "configuration": "run_experiment.precision = 'auto'", "expframe": precision.value,
             "note": "probe: " + autotune.ratios_text(precision.seconds, auto_settings.precision_candidates(
                 auto_settings.probe_device(target))) if precision.seconds else "not measured"}]
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        try:
            jit = auto_settings.jit_choice(target, 1)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        rows.append({"section": "auto", "configuration": f"Replicator.jit_compile = 'auto' ({policy}, 1 replica)",
                     "expframe": "off" if jit is None else jit.value,
                     "note": ("not measured: off on this target (expframe/replicator/auto_settings.py)" if jit is None
                              else "probe: " + autotune.ratios_text(jit.seconds, ("off", "on")))})
    return rows


def resnet_rows(target: str, sizes: dict, precisions: Sequence[str], jits: Sequence[bool], deadline: float,
                emit) -> List[Dict]:
    """ResNet images/s per precision and XLA setting, three runners each (see the module docstring)."""
    rows, durations = [], []
    label = f"ResNet-{sizes['depth']} {sizes['size']}px, batch {sizes['global_batch']}, images/s"
    for precision in precisions:
        for jit in jits:
            configuration = f"{precision}, XLA {'on' if jit else 'off'}"
            if not should_start(durations, time.time(), deadline):
                row = {"section": "resnet", "configuration": configuration, "label": label,
                       "note": "skipped (time budget)"}
                rows.append(row)
                emit(row)
                continue
            started = time.time()
            setup = r50.Setup(sizes["size"], 1, precision, sizes["global_batch"], sizes["steps"], "same", target,
                              jit, sizes["depth"], fit_strategy_kind="none")
            row = {"section": "resnet", "configuration": configuration, "label": label}
            try:
                measured = r50.measure(setup, sizes["repeats"], RUNNERS)
                for name in RUNNERS:
                    row[name] = round(measured[name]["images_per_sec"], 2)
                default = "on" if measured["keras_fit"]["keras_default_jit_compile"] else "off"
                ratios = measured["spread"]
                row["note"] = (f"expframe/handwritten {_interval(ratios['expframe_over_handwritten'])}, "
                               f"expframe/fit {_interval(ratios['expframe_over_keras_fit'])} (paired, "
                               f"{sizes['repeats']} repeats); Keras fit's default here: XLA {default}")
                row["measured"] = measured
            except Exception as e:  # pylint: disable=broad-except  (a failing cell is a result)
                row["note"] = f"FAILED: {type(e).__name__}: {_first_line(e)}"
            durations.append(time.time() - started)
            rows.append(row)
            emit(row)
    return rows


def _interval(found: dict) -> str:
    """`0.97 (0.95-1.00)`: a paired ratio's median and 95 % interval (expframe/reproduce/spread.py)."""
    return f"{found['median']:.2f} ({found['low']:.2f}-{found['high']:.2f})"


def matrix_rows(target: str, entry: str, timeout_s: float) -> List[Dict]:
    """The conformance matrix on `target` through its entry point, in a subprocess."""
    module, _, function = entry.partition(":")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return [{"section": "matrix", "configuration": f"all tasks x precisions on '{target}'",
                 "expframe": "not available", "note": f"{entry} is not installed (the conformance matrix)"}]
    code = ("import json, sys, importlib; module = importlib.import_module(sys.argv[1]); "
            "fn = getattr(module, sys.argv[2], None); "
            "print('MATRIX ' + json.dumps(None if fn is None else fn(sys.argv[3])))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        # Its own session, stopped with this script or at the timeout (expframe.processes);
        # stdout and stderr come together.
        done = processes.run([sys.executable, "-c", code, module, function, target], "conformance matrix",
                             cwd=ROOT, env=env, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return [{"section": "matrix", "configuration": f"all on '{target}'", "expframe": "FAILED",
                 "note": f"did not finish within {timeout_s:.0f} s (time budget)"}]
    lines = [line for line in done.stdout.splitlines() if line.startswith("MATRIX ")]
    if done.returncode != 0 or not lines:
        last = (done.stdout.strip().splitlines() or ["no output"])[-1]
        return [{"section": "matrix", "configuration": f"all on '{target}'", "expframe": "FAILED",
                 "note": f"exit {done.returncode}: {last[:200]}"}]
    found = json.loads(lines[-1][len("MATRIX "):])
    if found is None:
        return [{"section": "matrix", "configuration": f"all tasks x precisions on '{target}'",
                 "expframe": "not available", "note": f"{module} has no {function}() (the conformance matrix)"}]
    return [{"section": "matrix", "configuration": r.get("combination", "?"), "expframe": r.get("result", "?"),
             "note": r.get("agreement", "")} for r in found]


def d4pg_rows(target: str, steps: int, params: Sequence[str]) -> List[Dict]:
    """D4PG learner steps/s through main.py on `target`, 1 replica."""
    row = {"section": "d4pg", "configuration": f"learner steps/s, 1 replica, float32, {steps} steps"}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rate = d4pg_throughput.learner_rate(1, steps, tmp, (f"Replicator.target = '{target}'", *params))
            row.update(expframe=round(rate, 1), note="experiments/d4pg_control.gin (train step never compiled: "
                                                     "it calls the host)")
        except (Exception, SystemExit) as e:  # pylint: disable=broad-except
            lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            row.update(expframe="FAILED", note=lines[-1][-200:])  # main.py's last line: its error
    return [row]


# -- output ---------------------------------------------------------------------------------

def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:,.2f}" if isinstance(value, float) else str(value).replace("|", "/")


def markdown(rows: List[Dict]) -> str:
    """The one table: a header and a line per row (sections grouped in run order)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        section = row.get("label", row["section"])
        cells = [section, row.get("configuration"), row.get("expframe"), row.get("handwritten"),
                 row.get("keras_fit"), row.get("note")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: checks the logic in about a minute")
    parser.add_argument("--sections", nargs="+", default=["auto", "resnet", "matrix", "d4pg"],
                        choices=["auto", "resnet", "matrix", "d4pg"])
    parser.add_argument("--precisions", nargs="+", default=["float32", "mixed_float16"])
    parser.add_argument("--jit", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--matrix", default=DEFAULT_MATRIX, help="the matrix's entry point, module:function")
    parser.add_argument("--budget_s", type=float, default=450.0, help="seconds for the whole check")
    for name in ("size", "depth", "global_batch", "steps", "repeats"):  # override the ResNet sizes
        parser.add_argument(f"--{name}", type=int, default=None, help=f"ResNet {name} (default: {FULL[name]})")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.target == "gpu" and not tf.config.list_physical_devices("GPU"):
        print("error: --target=gpu but TensorFlow sees no GPU here; run it on a GPU machine "
              "(or --target=cpu --tiny to check the script)", file=sys.stderr)
        return 2
    sizes = dict(TINY if args.tiny else FULL)
    sizes.update({k: getattr(args, k) for k in ("size", "depth", "global_batch", "steps", "repeats")
                  if getattr(args, k) is not None})
    started = time.time()
    deadline = started + args.budget_s
    reserve = sum(RESERVE_S[s] for s in ("matrix", "d4pg") if s in args.sections)
    result = {"benchmark": "gpu_check", "target": args.target, "tiny": args.tiny, "device": device_description(
        args.target), "tensorflow": tf.__version__, "platform": platform.platform(), "sizes": sizes,
        "load_average_1min": {"start": os.getloadavg()[0]}, "rows": []}
    print(f"gpu_check on {result['device']} (target '{args.target}'); budget {args.budget_s:.0f} s", flush=True)

    def emit(row):
        result["rows"].append(row)
        result["wall_s"] = round(time.time() - started, 1)
        write_result(args.out, result, say=False, default=str)
        print("  " + " | ".join(_cell(row.get(k)) for k in ("section", "configuration", *RUNNERS, "note")),
              flush=True)

    if "auto" in args.sections:
        for row in auto_rows(args.target):
            emit(row)
    if "resnet" in args.sections:
        resnet_rows(args.target, sizes, args.precisions, [j == "on" for j in args.jit], deadline - reserve, emit)
    if "matrix" in args.sections:
        for row in matrix_rows(args.target, args.matrix, deadline - RESERVE_S["d4pg"] - time.time()):
            emit(row)
    if "d4pg" in args.sections:
        for row in d4pg_rows(args.target, sizes["d4pg_steps"], sizes["d4pg_params"]):
            emit(row)
    result["load_average_1min"]["end"] = os.getloadavg()[0]
    result["wall_s"] = round(time.time() - started, 1)
    result["markdown"] = markdown(result["rows"])
    write_result(args.out, result, say=False, default=str)
    print()
    print(result["markdown"])
    print(f"\n{result['device']}; load average {result['load_average_1min']['start']:.2f} at start, "
          f"{result['load_average_1min']['end']:.2f} at end; {result['wall_s']:.0f} s; wrote {args.out}")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(result["markdown"] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
