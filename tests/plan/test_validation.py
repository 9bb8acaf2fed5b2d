"""The device model against published ResNet-50 measurements (issue 60): the fit and its
rows, each parameter shared by more than one device family, every family left out of
the fit in turn, the held-out runs (never fitted), weak scaling inside a host, and the
tables docs/planning.md holds, regenerated. Plain Python (scipy's optimiser)."""

import builtins
import os
import re

import pytest

from expframe.plan import anchors, catalogue, model, validation

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _doc_block(name):
    with open(os.path.join(_ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        doc = f.read()
    found = re.search(rf"<!-- {name}:begin[^>]*-->\n(.*?)\n<!-- {name}:end -->", doc, re.S)
    assert found, f"docs/planning.md lost its {name} markers"
    return found.group(1).strip()


@pytest.fixture(scope="module")
def left_out():
    return validation.families()  # six refits, about 12 s


# -- the fit ---------------------------------------------------------------------------------

def test_the_fit_reproduces_the_catalogues_parameters():
    stored = catalogue.efficiency_parameters()
    fitted = anchors.fit()
    assert set(fitted) == set(catalogue.efficiency_priors())
    for name, value in fitted.items():
        assert value == pytest.approx(stored[name], rel=0.02, abs=1e-4), name
    # Within their bounds, not at them: no parameter is pinned by a bound (u_vector is stated, not fitted).
    for name, value in stored.items():
        if name in anchors.BOUNDS:
            low, high = anchors.BOUNDS[name]
            assert low + 1e-3 * (high - low) < value < high - 1e-3 * (high - low), name


def test_the_anchors_table_holds_against_published_measurements():
    data = anchors.load()
    rows = anchors.table(data)
    s = anchors.summary(rows)
    assert s["fitted"] >= 20 and {anchors.family(r) for r in rows} >= {"P100", "V100", "A100", "H100", "TPU v3",
                                                                          "TPU v4"}
    assert s["median_abs_error"] <= 0.10 and s["worst_ratio"] <= 1.3
    software = anchors.stacks(data)
    for r in rows:
        assert r["role"] in ("fitted", "repeat") and r["source"] in data["sources"] and r["derivation"]
        assert r["software"] in software
        if r["source"] == "ngc_tf":  # NVIDIA's README: the revision read, and where revisions differ
            assert r["revision"] == "b2e7f4a2" and "4eaa4434" in data["sources"]["ngc_tf"]
    assert "808 / 1,770" in data["sources"]["ngc_tf"] and "909 / 2,375" in data["sources"]["ngc_tf"]
    assert {catalogue.published(r["device"]).peak_key(r["precision"]) for r in rows} == {"fp32", "tf32", "fp16",
                                                                                             "bf16"}


def test_a_repeat_is_a_fitted_configuration_published_again_and_is_not_fitted():
    data = anchors.load()
    by_id = {r["id"]: r for r in data["anchors"]}
    repeats = [r for r in data["anchors"] if r["role"] == "repeat"]
    assert [r["id"] for r in repeats] == ["rerun_v3_512"]
    key = ("device", "devices", "global_batch", "precision")
    for r in repeats:
        assert by_id[r["repeats"]]["role"] == "fitted"
        assert tuple(r[k] for k in key) == tuple(by_id[r["repeats"]][k] for k in key)
        assert r["id"] not in {a["id"] for a in anchors.fitted_rows(data)}
    with pytest.raises(ValueError, match="rerun_v3_512"):
        anchors.fit(repeats)


def test_every_parameter_but_tf32_is_pinned_by_more_than_one_device_family():
    """The per-device constants are gone: each fitted parameter is one for every device of
    its kind, and the rows that depend on it come from several families. TF32's ratio is
    the exception, and says so: A100 is the only device with published TF32 rows."""
    rows = anchors.fitted_rows()
    pins = validation.sensitivities(rows, catalogue.efficiency_parameters())
    by_id = {r["id"]: r for r in rows}
    for name, per_row in pins.items():
        families = {anchors.family(by_id[i]) for i, s in per_row.items() if abs(s) >= validation.PINNED}
        if name == "tf32_ratio":
            assert families == {"A100"}
        elif name in ("traffic_tpu", "fill_tpu"):
            assert families == {"TPU v3", "TPU v4"}, name
        else:
            assert len(families) >= 2, (name, families)
    assert "tf32_ratio" in catalogue._load()["efficiency"]["source"]  # noqa: SLF001  (its caveat, in the catalogue)


# -- leave one family out --------------------------------------------------------------------

def test_every_family_left_out_comes_back_within_1_5x(left_out):
    assert [res["family"] for res in left_out] == list(validation.LEFT_OUT)
    for res in left_out:
        fitted = [r for r in res["rows"] if r["role"] == "fitted"]
        assert fitted and all(1 / 1.5 <= r["ratio"] <= 1.5 for r in fitted), (res["family"], fitted)
        # Without the A100 rows no row depends on TF32's ratio: it stays at its prior.
        assert res["at_prior"] == (["tf32_ratio"] if res["family"] == "A100" else []), res["family"]
        if res["family"] == "A100":
            assert res["parameters"]["tf32_ratio"] == catalogue.efficiency_priors()["tf32_ratio"]
    # A repeat is predicted with its family and marked as a repeat, never counted as held out.
    v3 = next(res for res in left_out if res["family"] == "TPU v3")
    assert [r["role"] for r in v3["rows"] if r["id"] == "rerun_v3_512"] == ["repeat"]


def test_docs_planning_md_holds_the_leave_one_family_out_table(left_out):
    assert _doc_block("families") == validation.markdown_families(left_out).strip(), (
        "docs/planning.md's leave-one-family-out table is stale: python -m expframe.plan.validation --families")


def test_leave_out_names_an_unknown_family():
    with pytest.raises(ValueError, match="no fitted row of that family"):
        validation.leave_out("K80")


# -- the held-out runs -----------------------------------------------------------------------

def test_held_out_runs_meet_the_acceptance():
    rows = validation.held_out()
    s = validation.held_out_summary(rows)
    assert s["runs"] >= 12 and s["within_1_5"] == s["runs"] and s["within_1_2"] >= 10
    assert {"P100", "V100", "A100", "H100"} <= set(s["families"]) and {"TPU v3", "TPU v4"} <= set(s["families"])
    assert set(s["precisions"]) == {"fp32", "tf32", "fp16", "bf16"}
    assert s["devices"][0] == 1 and s["devices"][1] > 1000
    data = validation.load_held_out()
    for r in data["runs"]:
        assert r["source"] in data["sources"] and r["derivation"] and r["software"] in anchors.stacks()


def test_held_out_runs_are_never_fitted(monkeypatch):
    """Kept apart: other ids and configurations than anchors.json's; `fit` refuses them; and
    the fit never opens heldout.json (it still runs, to the same values, when reading it fails)."""
    runs = validation.load_held_out()["runs"]
    held = [r for r in runs if r["role"] == "held out"]
    anchored = anchors.load()["anchors"]
    key = ("device", "devices", "global_batch", "precision")
    assert not {r["id"] for r in runs} & {a["id"] for a in anchored}
    assert not {tuple(r[k] for k in key) for r in held} & {tuple(a[k] for k in key) for a in anchored}
    # The one run chosen at an anchors.json configuration is marked so and not counted.
    by_id = {a["id"]: a for a in anchored}
    for r in (r for r in runs if r["role"] == "repeat"):
        assert tuple(r[k] for k in key) == tuple(by_id[r["repeats"]][k] for k in key)
    with pytest.raises(ValueError, match="not fitted rows"):
        anchors.fit(held[:2])
    with pytest.raises(ValueError, match="not fitted rows"):
        anchors.fit(anchors.fitted_rows() + held[-1:])
    real_open = builtins.open

    def guarded(path, *args, **kwargs):
        if str(path).endswith("heldout.json"):
            raise AssertionError("the fit read heldout.json")
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", guarded)
    with pytest.raises(AssertionError, match="read heldout.json"):  # the guard works
        validation.load_held_out()
    fitted = anchors.fit()
    assert fitted["u_matrix"] == pytest.approx(catalogue.efficiency_parameters()["u_matrix"], rel=0.02)


def test_docs_planning_md_holds_the_held_out_table():
    assert _doc_block("heldout") == validation.markdown_held_out().strip(), (
        "docs/planning.md's held-out table is stale: python -m expframe.plan.validation --held_out")


def test_docs_planning_md_holds_the_parameters_table():
    assert _doc_block("parameters") == validation.markdown_parameters().strip(), (
        "docs/planning.md's parameters table is stale: python -m expframe.plan.validation --parameters")


def test_docs_planning_md_holds_the_balance_and_datasheet_tables():
    assert _doc_block("balance") == validation.markdown_balance().strip()
    assert _doc_block("datasheet") == validation.markdown_datasheet().strip()


def test_docs_planning_md_holds_the_generated_anchors_table():
    assert _doc_block("anchors") == anchors.markdown().strip(), (
        "docs/planning.md's anchors table is stale: regenerate it with python -m expframe.plan.anchors")


# -- scaling inside a host -------------------------------------------------------------------

def test_weak_scaling_1_to_8_a100_in_16_bit_lies_in_the_published_band():
    """NVIDIA's tables put weak scaling from 1 to 8 (or 16) GPUs at 16 bits at 83-94%: the
    planner's, for this framework's ResNet-50 with per-device batch norm at NVIDIA's 256
    images per GPU, lies in that band; it was 99% with the all-reduce alone."""
    weak = validation.weak_scaling("a100", per_gpu=256)
    assert 0.83 <= weak <= 0.94
    assert 0.83 <= validation.weak_scaling("a100_40gb", per_gpu=256) <= 0.94
    with open(os.path.join(_ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        assert f"**{weak:.0%}** at NVIDIA's 256 images per GPU" in f.read()
    # What costs it: TensorFlow's fixed cost of a step over several GPUs, not the all-reduce's bytes.
    fp, hw = anchors.footprint(), catalogue.published("a100")
    row = model.plan_row(fp, hw, 8, 2048, model.Settings(None, "mixed_float16"))
    assert row["grad_all_reduce_s"] < 0.01 * row["step_s"] < row["step_sync_s"]
    without = model.plan_row(fp, hw, 8, 2048, model.Settings(None, "mixed_float16", stack=model.Stack(
        "no_sync", step_sync=False)))
    assert without["examples_per_s"] / (8 * model.plan_row(fp, hw, 1, 256, model.Settings(
        None, "mixed_float16"))["examples_per_s"]) > 0.98
