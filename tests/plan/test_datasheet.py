"""A device described by its datasheet (issue 60): `--hardware=FILE.json` plans a device the
catalogue does not hold with the shared parameters alone, says so in its notes, plans
exactly as the catalogue when given the catalogue's figures, and a malformed file is one
line naming the file and the field. Plain Python: nothing is traced."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from expframe.errors import ConfigError
from expframe.plan import __main__ as cli
from expframe.plan import anchors, catalogue, datasheet, model, planner, table, validation

SETTINGS = {"gin_files": ["x.gin"], "global_batch_size": 2048, "train_steps": 1000, "steps_per_loop": 100,
            "precision": "auto", "d4pg": False}


def _write(folder, entry, name="device.json"):
    path = folder / name
    path.write_text(json.dumps(entry))
    return str(path)


def _as_datasheet(hw):
    """A catalogue device written out as a datasheet: its own figures, nothing of the model."""
    def link(x):
        return {"name": x.name, "bandwidth": x.bandwidth, "latency_s": x.latency_s}
    return {"name": f"{hw.name}_datasheet", "kind": hw.kind, "peak_flops": hw.peak_flops,
            "memory_bytes": hw.memory_bytes, "memory_bandwidth": hw.memory_bandwidth,
            "devices_per_host": hw.devices_per_host, "intra_host": link(hw.intra_host),
            "inter_host": link(hw.inter_host), "per_op_us": hw.per_op_s * 1e6}


def test_the_shipped_datasheet_plans_a_device_not_in_the_catalogue():
    hw = planner.hardware(validation.DATASHEET)
    assert hw.name == "h100_pcie" and hw.name not in catalogue.names() and hw.datasheet == validation.DATASHEET
    assert (hw.peak("mixed_float16"), hw.peak("float32"), hw.memory_bandwidth) == (756e12, 378e12, 2.0e12)
    assert hw.efficiency == catalogue.efficiency_parameters()  # the shared parameters, nothing of its own
    plan = planner.make_plan(anchors.experiment_footprint(), {"examples_per_epoch": 1_281_167}, SETTINGS, hw, [1, 8])
    one, eight = plan["rows"]
    assert plan["precision"] == "mixed_bfloat16" and plan["datasheet"] == validation.DATASHEET
    assert 2500 < one["examples_per_s"] < 4500 and eight["examples_per_s"] < 8 * one["examples_per_s"]
    # Between the A100 80 GB and the H100 SXM of the catalogue, as its figures are.
    a100, h100 = (planner.make_plan(anchors.experiment_footprint(), {}, SETTINGS, catalogue.published(n), [1])
                  for n in ("a100", "h100"))
    assert a100["rows"][0]["examples_per_s"] < one["examples_per_s"] < h100["rows"][0]["examples_per_s"]
    notes = "\n".join(table.notes(plan))
    assert "described by its datasheet" in notes and "shared parameters alone" in notes


def test_datasheet_prediction_beside_published_runs():
    """The H100 PCIe's MLPerf v3.0 runs, planned from its datasheet alone: within 1.25x."""
    rows = validation.datasheet_rows()
    assert [r["published"] for r in rows] == [35565, 18828]
    assert all(0.8 <= r["ratio"] <= 1.25 for r in rows), rows


def test_a_datasheet_with_the_catalogues_figures_plans_as_the_catalogue(tmp_path):
    for name in ("a100", "v100"):
        hw = catalogue.published(name)
        described = datasheet.load(_write(tmp_path, _as_datasheet(hw), f"{name}.json"))
        for n, batch in ((1, 256), (8, 2048), (64, 8192)):
            st = model.Settings(None, "mixed_float16")
            want, got = model.plan_row(anchors.footprint(), hw, n, batch, st), model.plan_row(
                anchors.footprint(), described, n, batch, st)
            assert got["step_s"] == pytest.approx(want["step_s"], rel=1e-12), (name, n)
    p100 = dataclasses.replace(catalogue.published("p100"))
    entry = {**_as_datasheet(p100), "matrix_keys": []}  # no Tensor Cores: fp16 on the CUDA cores
    assert datasheet.load(_write(tmp_path, entry)).efficiency_key("mixed_float16") == "u_vector"


GOOD = {"kind": "gpu", "peak_flops": {"fp32": 1e13, "fp16": 1e14}, "memory_bytes": 1.6e10, "memory_bandwidth": 9e11,
        "devices_per_host": 8, "intra_host": {"name": "x", "bandwidth": 1e11, "latency_s": 5e-6},
        "inter_host": {"name": "y", "bandwidth": 1e10, "latency_s": 1e-5}}


@pytest.mark.parametrize("change, field", [
    ({"kind": "fpga"}, "'kind' must be one of gpu, tpu"),
    ({"peak_flops": {"fp8": 1e15}}, "'peak_flops.fp8' is not a precision key"),
    ({"peak_flops": {"fp16": "lots"}}, "'peak_flops.fp16' must be a positive number (FLOP/s), got 'lots'"),
    ({"memory_bandwidth": -1}, "'memory_bandwidth' must be a positive number (bytes/s)"),
    ({"devices_per_host": 2.5}, "'devices_per_host' must be a whole number"),
    ({"intra_host": {"name": "x", "bandwidth": 1e11}}, "'intra_host.latency_s' is missing"),
    ({"topology": "mesh"}, "'topology' must be one of ring, torus2d, torus3d"),
    ({"memory_bytes": None}, "'memory_bytes' must be a positive number (bytes)"),
])
def test_a_malformed_datasheet_names_the_file_and_the_field(tmp_path, change, field):
    path = _write(tmp_path, {**GOOD, **change})
    with pytest.raises(ConfigError) as e:
        datasheet.load(path)
    message = str(e.value)
    assert message.startswith(f"--hardware={path}: field ") and field in message and "\n" not in message
    missing = {k: v for k, v in GOOD.items() if k != "inter_host"}
    with pytest.raises(ConfigError, match=r"field 'inter_host' is missing"):
        datasheet.load(_write(tmp_path, missing, "missing.json"))


def test_a_datasheet_that_is_not_there_or_not_json(tmp_path):
    with pytest.raises(ConfigError, match=r"--hardware=.*nope.json: cannot read it"):
        datasheet.load(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{\"kind\": ")
    with pytest.raises(ConfigError, match=r"--hardware=.*bad.json: not JSON \(line 1"):
        datasheet.load(str(bad))


def test_the_command_line_refuses_a_malformed_datasheet_in_one_line(tmp_path, capsys):
    path = _write(tmp_path, {**GOOD, "memory_bandwidth": "fast"})
    code = cli.main(["--gin_file=quickstart", f"--hardware={path}", "--devices=8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err == (f"error: --hardware={path}: field 'memory_bandwidth' must be a positive number (bytes/s), "
                   "got 'fast'")


def test_the_command_line_accepts_a_datasheet_before_tensorflow_starts():
    code = ("import sys; from expframe.plan import __main__ as m; a = m._parser().parse_args(['--gin_file=quickstart', "
            f"'--hardware={validation.DATASHEET}', '--devices=1,8']); assert m.check(a) is None; "
            "assert 'tensorflow' not in sys.modules")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
