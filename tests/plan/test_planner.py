"""Putting a plan together (expframe/plan/planner.py): rows from a footprint, the model
axis of a mesh, D4PG's learner against its actors, precision 'auto', bad device counts.
Plain Python: the footprint is given, nothing is traced."""

import pytest

from expframe.errors import ConfigError
from expframe.plan import catalogue, model, planner

FP = model.Footprint(flops_fixed=0.0, flops_per_example=1e9, param_bytes=8e8, grad_bytes=8e8, slot_bytes=1.6e9,
                     activation_bytes_fixed=0.0, activation_bytes_per_example=1e7, num_params=2 * 10**8)
SETTINGS = {"gin_files": ["x.gin"], "global_batch_size": 256, "train_steps": 1000, "steps_per_loop": 10,
            "precision": "auto", "samples_per_insert": 32.0, "num_actors": 0, "d4pg": False}


def test_rows_epoch_and_precision():
    plan = planner.make_plan(FP, {"examples_per_epoch": 25_600}, SETTINGS, catalogue.published("a100"), [1, 8])
    a100 = catalogue.published("a100")
    assert plan["precision"] == "mixed_bfloat16" and plan["peak_flops"] == 312e12
    assert plan["utilisation"] == a100.efficiency["u_matrix"] and "fitted" in plan["utilisation_source"]
    assert "u_matrix" in plan["utilisation_source"] and "shared by every GPU" in plan["utilisation_source"]
    one, eight = plan["rows"]
    assert one["epoch_s"] == pytest.approx(100 * one["step_s"]) and one["to_last_step_s"] == pytest.approx(
        1000 * one["step_s"])
    assert eight["per_replica_batch"] == 32 and eight["efficiency"] < 1.0
    assert planner.resolve_precision("auto", catalogue.published("v100")) == "mixed_float16"
    assert planner.resolve_precision("auto", catalogue.published("v3")) == "mixed_bfloat16"


def test_a_mesh_divides_the_model_over_its_model_axis():
    mesh = model.Footprint(**{**FP.__dict__, "model_axis": 4})
    hw = catalogue.published("h100")
    plan = planner.make_plan(mesh, {}, SETTINGS, hw, [8], utilisation=0.5)
    row = plan["rows"][0]
    assert (row["data_axis"], row["model_axis"], row["per_replica_batch"]) == (2, 4, 128)
    assert row["memory_bytes"]["params"] == 2e8 and row["memory_bytes"]["slots"] == 4e8
    dev = model.device_time(mesh, hw, 128, plan["precision"], 0.5)
    assert dev["compute_roof_s"] == pytest.approx(128 * 1e9 / 4 / (989.5e12 * 0.5) * (1 + hw.fill_batch / 128))
    assert row["compute_s"] + row["hbm_s"] == pytest.approx(dev["device_s"])
    assert row["comm_s"] == pytest.approx(model.ring_all_reduce_s(2e8, 2, hw.intra_host, tree=True)
                                          + hw.efficiency["step_sync_s"])  # 2 GPUs on the data axis
    with pytest.raises(ConfigError, match="model axis of 4"):
        planner.make_plan(mesh, {}, SETTINGS, hw, [6])


def test_d4pg_learner_against_its_actors():
    settings = dict(SETTINGS, d4pg=True)
    plan = planner.make_plan(FP, {"actor_env_steps_per_s": 1000.0}, settings, catalogue.published("v100"), [1],
                             actors=4)
    (d4pg,) = plan["d4pg"]
    learner = 1.0 / plan["rows"][0]["step_s"]
    assert d4pg["env_steps_needed_per_s"] == pytest.approx(learner * 256 / 32.0)  # 8 environment steps per update
    assert d4pg["actor_env_steps_per_s"] == 4000.0
    assert d4pg["paced_learner_steps_per_s"] == pytest.approx(min(learner, 4000.0 / 8))
    assert learner < 500 and "bound by learner" in plan["d4pg_lines"][0]  # ResNet-sized steps: the learner is slower
    slow = planner.make_plan(FP, {}, settings, catalogue.published("v100"), [1], actors=2, actor_steps_per_s=100.0)
    assert slow["d4pg"][0]["paced_learner_steps_per_s"] == pytest.approx(200.0 / 8)
    assert "bound by actors" in slow["d4pg_lines"][0]


def test_a_batch_the_devices_do_not_divide_is_a_config_error():
    with pytest.raises(ConfigError, match="global batch 256 is not divisible by 3"):
        planner.make_plan(FP, {}, SETTINGS, catalogue.published("a100"), [3])
