"""benchmarks/gpu_check.py's logic on the CPU target at tiny sizes (CI has no GPU):
every section runs and lands in the one table and the JSON; the budget, a missing
matrix and a missing GPU are handled."""

import json
import os
import subprocess
import sys

import pytest

from expframe.reproduce import spread
from tests import main_runner as mr

BENCHMARKS = os.path.join(mr.ROOT, "benchmarks")


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import gpu_check as module  # pylint: disable=import-outside-toplevel
    return module


def test_every_section_on_the_cpu_target(tmp_path):
    out, table = tmp_path / "gpu_check.json", tmp_path / "table.md"
    cmd = [sys.executable, os.path.join(BENCHMARKS, "gpu_check.py"), "--target=cpu", "--tiny",
           "--sections", "auto", "resnet", "matrix", "--precisions", "mixed_float16", "--jit", "off",
           "--matrix", "tests.fake_conformance:run_target",
           f"--out={out}", f"--markdown={table}"]
    done = subprocess.run(cmd, cwd=mr.ROOT, env=mr.env(tmp_path / "tfds"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by_section = {}
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
    assert [r["section"] for r in rows] == ["auto"] * 3 + ["resnet", "matrix", "matrix"]
    # auto: the precision measured (or cached) on this CPU; XLA off on CPUs, not measured.
    precision, *jit = by_section["auto"]
    assert precision["expframe"] in ("float32", "mixed_bfloat16") and "the speed of float32" in precision["note"]
    assert [r["expframe"] for r in jit] == ["off", "off"] and all("not measured" in r["note"] for r in jit)
    # resnet: three runners timed under mixed_float16, Keras' default XLA choice noted. (XLA on
    # the CPU adds half a minute of compiling here; `--jit on` was run by hand.)
    resnet, = by_section["resnet"]
    assert resnet["configuration"] == "mixed_float16, XLA off"
    assert all(resnet[name] > 0 for name in ("expframe", "handwritten", "keras_fit")), resnet
    assert resnet["measured"]["jit_compile"] is False and resnet["measured"]["precision"] == "mixed_float16"
    assert "Keras fit's default here: XLA off" in resnet["note"]  # Keras: off on a CPU-only machine
    # matrix: the entry point's rows as they came.
    assert [(r["configuration"], r["expframe"]) for r in by_section["matrix"]] == [
        ("classification cpu x1 float32", "runs"), ("d4pg cpu x1 mixed_float16", "refused")]
    # One table, on stdout and in the markdown file: a header and one line per row.
    lines = table.read_text().strip().splitlines()
    assert lines[0] == "| section | configuration | expframe | handwritten | keras fit | note |"
    assert len(lines) == 2 + len(rows) and all(line in done.stdout for line in lines)


def test_d4pg_runs_main_py_on_the_target_and_a_failure_is_a_row(gpu_check, monkeypatch):
    calls = []

    def fake_learner_rate(replicas, steps, tmp, extra_params=()):
        calls.append((replicas, steps, tuple(extra_params)))
        if len(calls) == 2:
            raise SystemExit("learner run failed:\nerror: something went wrong")
        return 123.4

    monkeypatch.setattr(gpu_check.d4pg_throughput, "learner_rate", fake_learner_rate)
    ok, = gpu_check.d4pg_rows("gpu", 600, ())
    failed, = gpu_check.d4pg_rows("cpu", 20, gpu_check.TINY["d4pg_params"])
    assert calls[0] == (1, 600, ("Replicator.target = 'gpu'",))
    assert calls[1] == (1, 20, ("Replicator.target = 'cpu'", *gpu_check.TINY["d4pg_params"]))
    assert ok["expframe"] == 123.4 and ok["section"] == "d4pg"
    assert failed["expframe"] == "FAILED" and failed["note"] == "error: something went wrong"


def test_configurations_start_only_while_the_slowest_fits(gpu_check):
    assert gpu_check.should_start([], now=100.0, deadline=50.0)  # the first always starts
    assert gpu_check.should_start([10.0, 30.0], now=100.0, deadline=130.0)
    assert not gpu_check.should_start([10.0, 30.0], now=100.0, deadline=129.0)


def test_skipped_configurations_are_rows_of_the_table(gpu_check, monkeypatch):
    measured = []

    def fake_measure(setup, repeats, runners):
        measured.append(setup)
        row = {name: {"images_per_sec": 10.0, "keras_default_jit_compile": True} for name in runners}
        # The paired ratios of the three repeats, and their spread as resnet50_throughput.measure writes it.
        return dict(row, expframe_over_handwritten_paired=1.0, expframe_over_keras_fit_paired=0.5,
                    spread={"expframe_over_handwritten": spread.of([0.98, 1.0, 1.03]),
                            "expframe_over_keras_fit": spread.of([0.45, 0.5, 0.52])})

    monkeypatch.setattr(gpu_check.r50, "measure", fake_measure)
    rows = []
    got = gpu_check.resnet_rows("gpu", gpu_check.FULL, ["float32"], [False, True], deadline=0.0, emit=rows.append)
    assert got == rows and len(rows) == 2 and len(measured) == 1
    first, skipped = rows
    assert (first["configuration"], first["expframe"], skipped["configuration"]) == (
        "float32, XLA off", 10.0, "float32, XLA on")
    assert first["note"] == ("expframe/handwritten 1.00 (0.98-1.03), expframe/fit 0.50 (0.45-0.52) (paired, 3 "
                             "repeats); Keras fit's default here: XLA on")
    assert skipped["note"] == "skipped (time budget)" and "expframe" not in skipped
    setup = measured[0]  # the configuration the check promises: ResNet-50 at 224 on the target, fit without strategy
    assert (setup.depth, setup.size, setup.target, setup.jit_compile, setup.fit_strategy_kind) == (
        50, 224, "gpu", False, "none")


def test_a_missing_matrix_is_reported_not_failed(gpu_check):
    for entry in ("tests.no_such_module:run_target", "tests.fake_conformance:no_such_function"):
        row, = gpu_check.matrix_rows("gpu", entry, timeout_s=60)
        assert row["expframe"] == "not available", row


def test_gpu_target_without_a_gpu_is_one_line_and_exit_2(gpu_check, capsys, tmp_path):
    assert gpu_check.main(["--target=gpu", f"--out={tmp_path / 'x.json'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --target=gpu but TensorFlow sees no GPU")
    assert not (tmp_path / "x.json").exists()
