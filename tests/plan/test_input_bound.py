"""The planner's input bound (issue 62): the reference hosts' CPU cores and their sources,
the measured per-core rate and its file, where the rate applies, a case where the input
binds (H100 at NVIDIA's published rate) and one where it does not (V100), the data-service
cores the notes name, this machine's rows unchanged when the input is stated, and
docs/planning.md's tables, regenerated. Plain Python: nothing is traced."""

import dataclasses
import json
import math
import os
import re

import pytest

from expframe.errors import ConfigError
from expframe.plan import __main__ as cli
from expframe.plan import anchors, catalogue, datasheet, input_bound, input_rate, input_table, model, planner, table

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHEET = os.path.join(_ROOT, "expframe", "plan", "datasheets", "h100_pcie.json")
RATE = input_rate.InputRate(390.0, "a test core", "stated for the test", "test")
IMAGENET = {"gin_files": ["x.gin"], "global_batch_size": 1024, "train_steps": 1000, "steps_per_loop": 100,
            "precision": "auto", "d4pg": False, "train_input": "imagenet_input", "mock_input": False}


# -- the catalogue's hosts -------------------------------------------------------------------

def test_each_reference_host_has_its_cores_per_device_and_a_source():
    """Physical cores per device: DGX-1 40 / 8, DGX A100 128 / 8, DGX H100 112 / 8; TPU hosts
    given in vCPUs, halved (2 vCPUs = 1 core): v2/v3 96 / 2 / 4, v4 240 / 2 / 4, v5e 224 / 2 / 8,
    v5p 208 / 2 / 4."""
    want = {"p100": 5, "v100": 5, "v100_32gb": 5, "a100_40gb": 16, "a100": 16, "h100": 14, "h200": 14, "v2": 12,
            "v3": 12, "v4": 30, "v5e": 14, "v5p": 26}
    assert set(want) == set(catalogue.names()) - {"cpu"} == set(input_table.ORDER)
    for name, cores in want.items():
        hw = catalogue.published(name)
        assert hw.host_cores_per_device == cores, name
        assert "host_cores_rule" not in hw.sources["host_cpu"] and "2 vCPUs = 1" in hw.sources["host_cpu"], name
    tpus = {n for n in want if catalogue.published(n).kind == "tpu"}
    assert all("vCPUs" in catalogue.published(n).host_cpu for n in tpus)
    # What could not be verified says so, in the catalogue.
    for name in ("p100", "v4", "v2"):
        assert "not verified" in catalogue.published(name).sources["host_cpu"], name
    assert catalogue.host_cores({"name": "x", "vcpus": 224}, "f") == ("x: 224 vCPUs = 112 cores", 112.0)
    assert catalogue.VCPUS_PER_CORE == 2


@pytest.mark.parametrize("entry, field", [({"name": "x"}, "'host_cpu'"), ({"name": "x", "cores": 8, "vcpus": 16},
                                                                             "'host_cpu'"),
                                          ({"name": "x", "vcpus": 0}, "'host_cpu.vcpus'"),
                                          ({"name": "x", "cores": "many"}, "'host_cpu.cores'")])
def test_a_malformed_host_cpu_in_a_datasheet_is_one_line_naming_the_file_and_field(tmp_path, entry, field):
    with open(SHEET, encoding="utf-8") as f:
        sheet = json.load(f)
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({**sheet, "host_cpu": entry}))
    with pytest.raises(ConfigError) as e:
        datasheet.load(str(path))
    assert str(e.value).startswith(f"--hardware={path}: field {field}") and "\n" not in str(e.value)
    shipped = datasheet.load(SHEET)
    assert shipped.host_cores_per_device == 16 and "EPYC 9554" in shipped.host_cpu


# -- the measured rate -----------------------------------------------------------------------

def test_the_shipped_rate_is_a_measurement_with_its_provenance():
    rate = input_rate.load()
    assert rate.images_per_sec_per_core > 0 and rate.path == input_rate.DEFAULT
    assert "decode_and_crop_jpeg" in rate.source or "benchmarks" in rate.source
    assert "AVX-512" in rate.cpu or "avx512" in rate.cpu.lower()


@pytest.mark.parametrize("text, field", [
    ('{"cpu": "c", "source": "s"}', "'images_per_sec_per_core' is missing"),
    ('{"images_per_sec_per_core": -3, "cpu": "c", "source": "s"}', "'images_per_sec_per_core' must be a positive"),
    ('{"images_per_sec_per_core": "fast", "cpu": "c", "source": "s"}', "'images_per_sec_per_core' must be"),
    ('{"images_per_sec_per_core": 390, "source": "s"}', "'cpu' is missing"),
    ('{"images_per_sec_per_core": 390, "cpu": "", "source": "s"}', "'cpu' must be a non-empty text"),
    ('{"images_per_sec_per_core": 390, "cpu": "c"', "not JSON"),
    ('[390]', "must hold one JSON object"),
])
def test_a_malformed_rate_file_is_one_line_naming_the_file_and_field(tmp_path, monkeypatch, capsys, text, field):
    path = tmp_path / "input_rate.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        input_rate.load(str(path))
    message = str(e.value)
    assert message.startswith(f"{path}: ") and field in message and "\n" not in message
    assert "--input_us_per_example" in message  # what to do
    # The command line: one line, exit 2, before TensorFlow starts; stating the input needs no rate.
    monkeypatch.setattr(input_rate, "DEFAULT", str(path))
    assert cli.main(["--gin_file=quickstart", "--hardware=h100", "--devices=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and field in err and err.count("\n") == 1
    args = cli._parser().parse_args(["--gin_file=quickstart", "--hardware=h100", "--devices=8",  # noqa: SLF001
                                     "--input_us_per_example=100"])
    assert cli.check(args) is None


def test_the_benchmarks_result_fields_are_all_the_loader_reads(tmp_path):
    """benchmarks/results/imagenet_input.json's structure: a later edit of the file is all it takes."""
    path = tmp_path / "imagenet_input.json"
    path.write_text(json.dumps({"images_per_sec_per_core": 512.5, "cpu": "c", "source": "benchmarks/imagenet_input.py",
                                "interval": [500, 525], "threads": [1, 2]}))
    assert input_rate.load(str(path)) == input_rate.InputRate(512.5, "c", "benchmarks/imagenet_input.py", str(path))


# -- where the rate applies ------------------------------------------------------------------

def test_the_rate_applies_to_imagenet_classification_on_a_known_host_only():
    h100 = catalogue.published("h100")
    chosen = input_bound.choose(IMAGENET, h100, rate=RATE)
    assert chosen.predicted and chosen.core_s_per_example == pytest.approx(1 / 390) and not chosen.s_per_example
    assert "390 images/s per core" in chosen.note and "14 cores per device" in chosen.note
    assert input_bound.choose(IMAGENET, h100, host_core_factor=2.0, rate=RATE).core_s_per_example == pytest.approx(
        1 / 780)
    cpu = catalogue.measured_cpu(1e11, copy_bandwidth=1e10)
    no_host = dataclasses.replace(h100, host_cores_per_device=None, host_cpu=None)
    for settings, hw, reason in (
            (dict(IMAGENET, train_input=None, d4pg=True), h100, "not imagenet_input"),      # D4PG, a GAN, shapes
            (dict(IMAGENET, train_input="shapes_input"), h100, "not imagenet_input"),       # synthetic images
            (dict(IMAGENET, mock_input=True), h100, "mock ImageNet"),
            (IMAGENET, cpu, "on this machine"),
            (IMAGENET, no_host, "host CPU of h100 is not known")):
        chosen = input_bound.choose(settings, hw, rate=RATE)
        assert not chosen.predicted and chosen.core_s_per_example == chosen.s_per_example == 0.0
        assert chosen.note.startswith("assumed to keep up") and reason in chosen.note, reason
        # Stated, the time is used as given, whatever the experiment.
        stated = input_bound.choose(settings, hw, stated_us=250.0, rate=RATE)
        assert stated.s_per_example == pytest.approx(250e-6) and not stated.predicted
    assert input_bound.choose(IMAGENET, h100, stated_us=0.0, rate=RATE).note.startswith("assumed to keep up")


# -- binds, keeps up -------------------------------------------------------------------------

def _nvidia_h100():
    """MLPerf v3.0's DGX H100 run (anchors.json mlperf30_dgxh100: 8 H100, 400 per GPU, MXNet's
    fused kernels), planned alone and with the host's input at 390 images/s per core."""
    data = anchors.load()
    run = next(r for r in data["anchors"] if r["id"] == "mlperf30_dgxh100")
    hw, fp = anchors.hardware(run), anchors.footprint(data)
    st = model.Settings(None, run["precision"], compiled=True, stack=anchors.stacks(data)[run["software"]])
    fed = dataclasses.replace(st, input_core_s_per_example=1 / 390)
    return run, model.plan_row(fp, hw, 8, 3200, st), model.plan_row(fp, hw, 8, 3200, fed)


def test_input_binds_on_a_dgx_h100_at_nvidias_published_rate():
    """55,762 images/s on 8 H100 is 6,970 per GPU: 17.9 cores at 390 images/s per core, and a
    DGX H100 has 14 per GPU (112 for 8). The planner's own device rate for that run, 6,290 per
    GPU, needs 16.1: the input binds, the step is the host's 3,200 images over 112 cores,
    73.3 ms, and the GPUs wait: 5,460 images/s per GPU (14 x 390)."""
    run, alone, fed = _nvidia_h100()
    assert run["published"] / 8 / 390 == pytest.approx(17.87, abs=0.01)
    assert alone["examples_per_s"] / 8 == pytest.approx(6290, rel=0.01) and alone["bottleneck"] == "hbm"
    assert fed["input_time_s"] == pytest.approx(3200 / (112 * 390)) == pytest.approx(0.07326, rel=1e-3)
    assert fed["input_binds"] and fed["bottleneck"] == "input"
    assert fed["step_s"] == pytest.approx(fed["input_time_s"])  # the host's launches hide under the device step
    assert fed["examples_per_s"] / 8 == pytest.approx(14 * 390)
    device_s = alone["step_s"]
    assert fed["input_cores_needed"] == pytest.approx(3200 / 390 / device_s) == pytest.approx(129.0, rel=0.01)
    assert fed["input_service_cores"] == math.ceil(fed["input_cores_needed"] - 112) == 18
    assert fed["input_s"] == pytest.approx(fed["input_time_s"] - device_s)


def test_input_keeps_up_on_a_dgx1_v100():
    """NVIDIA's 8-V100 TensorFlow row (256 per GPU, float16): 2,048 images per step over the
    DGX-1's 40 cores take 131 ms, hidden under the 212 ms device step: the row is what it was."""
    data = anchors.load()
    run = next(r for r in data["anchors"] if r["id"] == "ngc_v100_8_amp")
    hw, fp = anchors.hardware(run), anchors.footprint(data)
    st = model.Settings(None, run["precision"], compiled=True, stack=anchors.stacks(data)[run["software"]])
    alone = model.plan_row(fp, hw, 8, 2048, st)
    fed = model.plan_row(fp, hw, 8, 2048, dataclasses.replace(st, input_core_s_per_example=1 / 390))
    assert fed["input_time_s"] == pytest.approx(2048 / (40 * 390)) == pytest.approx(0.1313, rel=1e-3)
    assert not fed["input_binds"] and fed["input_s"] == 0.0 and fed["input_service_cores"] == 0
    assert fed["step_s"] == alone["step_s"] == pytest.approx(2048 / 9653, rel=0.01)
    assert fed["bottleneck"] == alone["bottleneck"] == "hbm"
    assert fed["input_cores_needed"] == pytest.approx(2048 / 390 / alone["step_s"]) == pytest.approx(24.8, rel=0.01)


def test_a_plan_on_h100_names_input_and_the_service_cores_in_its_notes():
    """The planner end to end (footprint given): ResNet-50 at 256 per GPU on DGX H100s with a
    host core worth half of the measuring machine's (--host_core_factor=0.5): the input binds;
    the notes give the step per host, the cores that would keep up and the data-service
    worker cores that would lift the bound, per host and for all hosts."""
    fp = anchors.experiment_footprint()
    hw = catalogue.published("h100")
    settings = dict(IMAGENET, global_batch_size=256 * 16)
    plan = planner.make_plan(fp, {"examples_per_epoch": 1_281_167}, settings, hw, [8, 16], host_core_factor=0.5,
                             rate=RATE)
    assert plan["input"]["predicted"] and plan["input"]["images_per_sec_per_core"] == 390
    for row in plan["rows"]:
        per_host = row["per_replica_batch"] * 8  # 512 per GPU on one host, 256 on two
        assert row["input_examples_per_host"] == per_host and row["input_host_cores"] == 112
        assert row["input_time_s"] == pytest.approx(per_host / (112 * 195))
        assert row["input_binds"] and row["bottleneck"] == "input"
        device_s = row["compute_s"] + row["hbm_s"] + row["comm_s"]
        assert row["input_service_cores"] == math.ceil(per_host / 195 / device_s - 112)
    notes = "\n".join(table.notes(plan))
    assert "predicted: ImageNet's train preprocessing at 390 images/s per core x host_core_factor 0.5" in notes
    sixteen = plan["rows"][1]
    service = sixteen["input_service_cores"]
    head = f"16 devices, input: {table._ms(sixteen['input_time_s'])} ms per step per host"  # noqa: SLF001
    assert f"{head} (2,048 examples over 112 cores)" in notes
    assert (f"{math.ceil(sixteen['input_cores_needed'])} cores per host would keep up, the host has 112: {service} "
            f"data-service worker cores per host ({2 * service:,} for 2 hosts") in notes
    # At the measuring machine's core (factor 1) the same 512 per GPU keeps up on one host.
    kept = planner.make_plan(fp, {}, settings, hw, [8], rate=RATE)["rows"][0]
    assert not kept["input_binds"] and kept["input_s"] == 0.0 and kept["input_service_cores"] == 0


# -- this machine ----------------------------------------------------------------------------

FP = model.Footprint(flops_fixed=1e8, flops_per_example=2e8, param_bytes=4e6, grad_bytes=4e6, slot_bytes=8e6,
                     activation_bytes_fixed=0.0, activation_bytes_per_example=2e6, num_params=10**6, ops=1000)


@pytest.mark.parametrize("us", [1.0, 400.0, 20_000.0])
def test_this_machines_rows_are_unchanged_when_the_input_is_stated(us):
    """--hardware=cpu with --input_us_per_example: every row as the model before the input
    bound made it (the stated time x one replica's batch, beyond the step; the bottleneck
    the largest part), whatever the experiment's input, and its note the same words."""
    cpu = catalogue.measured_cpu(5e10, utilisation=0.4, copy_bandwidth=1e10, per_op_s=1e-5)
    for settings in (IMAGENET, dict(IMAGENET, train_input="shapes_input")):
        plan = planner.make_plan(FP, {}, dict(settings, global_batch_size=96), cpu, [1, 2, 4, 8],
                                 input_us_per_example=us, rate=RATE)
        base = planner.make_plan(FP, {}, dict(settings, global_batch_size=96), cpu, [1, 2, 4, 8],
                                 input_us_per_example=0.0, rate=RATE)
        assert plan["input_note"] == f"{us:g} us of host time per example, hidden by prefetch up to the device step"
        for row, zero in zip(plan["rows"], base["rows"], strict=True):
            device = row["compute_s"] + row["hbm_s"] + row["comm_s"]
            assert row["input_s"] == max(0.0, us * 1e-6 * row["per_replica_batch"] - device)
            assert row["step_s"] == device + row["input_s"] + row["host_s"]
            parts = {k: row[f"{k}_s"] for k in ("compute", "hbm", "comm", "input", "host")}
            assert row["bottleneck"] == max(parts, key=parts.get)
            for key in ("compute_s", "hbm_s", "comm_s", "host_s", "memory_bytes", "fits"):
                assert row[key] == zero[key], key
            assert row["input_host_cores"] is None and row["input_cores_needed"] is None
        assert not any("devices, input:" in line for line in table.notes(plan))


def test_this_machine_without_a_stated_input_keeps_the_assumption():
    cpu = catalogue.measured_cpu(5e10, utilisation=0.4, copy_bandwidth=1e10, per_op_s=1e-5)
    plan = planner.make_plan(FP, {}, dict(IMAGENET, global_batch_size=96), cpu, [2], rate=RATE)
    assert plan["rows"][0]["input_s"] == 0.0 and "on this machine" in plan["input_note"]


# -- the docs --------------------------------------------------------------------------------

def test_docs_planning_md_holds_the_input_tables():
    with open(os.path.join(_ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        doc = f.read()
    found = re.search(r"<!-- input_cores:begin[^>]*-->\n(.*?)\n<!-- input_cores:end -->", doc, re.S)
    assert found, "docs/planning.md lost its input_cores markers"
    assert found.group(1).strip() == input_table.markdown().strip(), (
        "docs/planning.md's input tables are stale: python -m expframe.plan.input_table")
    assert "(generated by python -m expframe.plan.input_table; do not edit by hand)" in doc


def test_the_input_tables_numbers():
    """The device table's columns are each other's arithmetic, and the published H100 row binds."""
    rows = {r["device"]: r for r in input_table.device_rows(RATE)}
    for row in rows.values():
        assert row["binds"] == (row["cores_needed_per_device"] > row["host_cores_per_device"]), row["device"]
        if not row["binds"]:
            assert row["fed_per_device"] == pytest.approx(row["alone_per_device"]), row["device"]
        else:
            assert row["fed_per_device"] == pytest.approx(row["host_cores_per_device"] * 390), row["device"]
    published = {r["id"]: r for r in input_table.published_rows(RATE)}
    h100 = published["mlperf30_dgxh100"]
    assert h100["cores_needed"] == pytest.approx(55_762 / 8 / 390) and h100["host_cores_per_device"] == 14
    assert h100["binds"] and h100["fed_per_device"] == pytest.approx(14 * 390)
    assert not published["mlperf06_dgx1"]["binds"] and not published["mlperf10_v4_128"]["binds"]
