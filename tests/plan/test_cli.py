"""`python -m expframe.plan` end to end on a tiny experiment (in-process), its JSON, and
its errors: bad input is one line and exit 2 (before TensorFlow starts); a plan that
does not fit in memory exits 0 with the table and names the shortfall."""

import json
import subprocess
import sys

import pytest

from expframe.plan import __main__ as cli
from expframe.plan import catalogue, planner

TINY = """
ClassificationTask.model = @resnet
resnet.depth = 8
resnet.num_classes = 10
resnet.input_shape = (16, 16, 3)
resnet.norm = @SyncBatchNorm
ClassificationTask.dataset = @imagenet_input
imagenet_input.image_size = 16
ClassificationTask.optimizer = @keras.optimizers.Adam
Replicator.target = 'cpu'
run_experiment.task = @ClassificationTask()
Trainer.global_batch_size = 64
Trainer.train_steps = 100
Trainer.steps_per_loop = 10
"""


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """One run of the planner on a ResNet-8 over mock ImageNet at 16 px: far too large a batch for a v5e."""
    folder = tmp_path_factory.mktemp("plan")
    (folder / "tiny.gin").write_text(TINY)
    out = folder / "plan.json"
    args = [f"--gin_file={folder / 'tiny.gin'}", "--hardware=v5e", "--devices=1,4", "--global_batch_size=1048576",
            f"--out={out}"]
    return cli.main(args), json.loads(out.read_text())


def test_a_plan_that_does_not_fit_exits_0_and_names_the_shortfall(tiny_plan, capsys):
    code, plan = tiny_plan
    assert code == 0
    one, four = plan["rows"]
    assert (one["devices"], one["per_replica_batch"], four["per_replica_batch"]) == (1, 1048576, 262144)
    assert not one["fits"] and one["bottleneck"] == "memory"
    memory = one["memory_bytes"]
    assert memory["device"] == 16e9
    assert one["shortfall_bytes"] == pytest.approx(memory["total"] - 16e9)
    assert memory["total"] == pytest.approx(sum(memory[k] for k in ("params", "grads", "slots", "activations")))


def test_the_plan_holds_the_measured_step_and_the_model(tiny_plan):
    _, plan = tiny_plan
    fp = plan["footprint"]
    assert fp["num_params"] > 70_000 and fp["grad_bytes"] <= fp["param_bytes"]
    assert fp["slot_bytes"] >= 2 * fp["grad_bytes"]  # Adam: two moments per trainable weight
    assert fp["sync_collectives"] == 7 and fp["flops_per_example"] > 0 and fp["ops"] > 100
    u = catalogue.efficiency_parameters()["u_matrix"]  # shared, fitted; a TPU runs float32 matmuls in bf16
    assert plan["precision"] == "float32" and plan["utilisation"] == u and plan["examples_per_epoch"] == 1_281_167
    one = plan["rows"][0]
    fill = catalogue.efficiency_parameters()["fill_tpu"]  # a small batch leaves the chip idle: not this one
    assert one["compute_roof_s"] == pytest.approx(
        (fp["flops_fixed"] + fp["flops_per_example"] * 1048576) / (197e12 * u) * (1 + fill / 1048576))
    # The longer roof counts in full, the shorter by its serial part.
    serial = catalogue.efficiency_parameters()["serial"]
    longer, shorter = sorted((one["compute_roof_s"], one["hbm_roof_s"]), reverse=True)
    assert one["compute_s"] + one["hbm_s"] == pytest.approx(longer + serial * shorter)
    assert fp["all_reduce_bytes"] == [fp["grad_bytes"]] and len(fp["sync_bn"]) == 7  # one update, 7 batch norms
    assert one["comm_s"] == 0.0 and plan["rows"][1]["comm_s"] > 0
    assert one["to_last_step_s"] == pytest.approx(100 * one["step_s"])
    # ClassificationTask.dataset = @imagenet_input on real data: the input is predicted, over
    # the v5e host's 14 cores per chip (224 vCPUs for 8 chips), at the measured per-core rate.
    assert plan["input"]["predicted"] and plan["host_cores_per_device"] == 14
    assert one["input_time_s"] == pytest.approx(1048576 / (14 * plan["input"]["images_per_sec_per_core"]))


@pytest.mark.parametrize("flags, message", [
    (["--gin_file=no/such.gin", "--hardware=v3", "--devices=8"], "--gin_file=no/such.gin: no such file"),
    (["--gin_file=quickstart", "--hardware=v9", "--devices=8"], "--hardware='v9' is not in the catalogue"),
    (["--gin_file=quickstart", "--hardware=v3", "--devices=8,0"], "--devices='8,0'"),
    (["--gin_file=quickstart", "--hardware=v3", "--devices=8", "--utilisation=1.5"], "--utilisation=1.5"),
    (["--gin_file=quickstart", "--hardware=v3", "--devices=8", "--out=/no/such/dir/p.json"], "--out="),
    (["--hardware=v3", "--devices=8"], "required: --gin_file"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) if "required" in message else _returns(2) as result:
        result.code = cli.main(flags)
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


class _returns:
    def __init__(self, code):
        self.expected = code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        assert self.code == self.expected
        return False


def test_bad_flags_fail_fast_without_tensorflow():
    code = ("import sys; from expframe.plan.__main__ import main; rc = main(['--gin_file=quickstart', "
            "'--hardware=v3', '--devices=x']); assert 'tensorflow' not in sys.modules; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --devices='x'")


def test_this_machine_is_measured():
    assert planner.cpu_flops(repeats=1) > 1e8          # FLOP/s of the probe's matmul and conv chain
    assert 0 < planner.cpu_per_op_s(length=100, repeats=1) < 0.01


def _epochs_config(folder, length: str):
    path = folder / "epochs.gin"
    path.write_text(TINY.replace("Trainer.train_steps = 100", length))
    return path


def test_a_config_in_epochs_is_planned_with_the_steps_the_trainer_would_run(tmp_path, capsys):
    """Trainer.train_epochs instead of train_steps: the last step is epochs x (train
    examples // global batch), as expframe/epochs.py counts it, at the planned batch."""
    path = _epochs_config(tmp_path, "Trainer.train_epochs = 2.5")
    out = tmp_path / "plan.json"
    assert cli.main([f"--gin_file={path}", "--hardware=v5e", "--devices=1", f"--out={out}"]) == 0
    plan = json.loads(out.read_text())
    per_epoch = 1_281_167 // 64                     # mock ImageNet plans ILSVRC 2012's train split
    assert plan["train_epochs"] == 2.5 and plan["train_steps"] == int(2.5 * per_epoch) == 50_045
    row = plan["rows"][0]
    assert row["to_last_step_s"] == pytest.approx(50_045 * row["step_s"])
    assert "Trainer.train_epochs = 2.5 is 50,045 steps at global batch 64" in capsys.readouterr().out
    assert cli.main([f"--gin_file={path}", "--hardware=v5e", "--devices=1", "--global_batch_size=128",
                     f"--out={out}"]) == 0
    assert json.loads(out.read_text())["train_steps"] == int(2.5 * (1_281_167 // 128)) == 25_022


@pytest.mark.parametrize("length, message", [
    ("Trainer.train_epochs = 2\nTrainer.train_steps = 100", "are both bound: bind one of them"),
    ("", "Trainer.train_steps and Trainer.train_epochs are both unbound"),
])
def test_a_config_without_one_length_is_one_line_and_exit_2(tmp_path, capsys, length, message):
    path = _epochs_config(tmp_path, length)
    assert cli.main([f"--gin_file={path}", "--hardware=v5e", "--devices=1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
