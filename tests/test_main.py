"""The experiment runner through its real entry point, main.py (DESIGN.md: CLI, Run outputs)."""

import glob
import json
import os
import signal

import gin
import numpy as np
import pytest
import tensorflow as tf

from expframe import config, experiment
from expframe.errors import ConfigError
from expframe.run_files import RunFiles
from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
DETERMINISTIC = mr.SMALL + ("run_experiment.deterministic = True",)


def _weights(model_dir):
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    names = sorted(n for n in reader.get_variable_to_shape_map() if n.startswith("model/"))
    assert names, "no model variables in the checkpoint"
    return {n: reader.get_tensor(n) for n in names}


def test_quickstart_smoke_writes_every_output(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    done = mr.run([QUICKSTART], model_dir, data_dir, mr.SMALL + ("Trainer.train_steps = 4",))
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("config.gin", "operative_config.gin", "metrics.jsonl", "result.json"):
        assert (model_dir / name).is_file(), name
    assert glob.glob(str(model_dir / "train" / "events.out.tfevents.*"))
    assert glob.glob(str(model_dir / "eval" / "events.out.tfevents.*"))
    assert mr.latest_step(model_dir) == 4
    result = json.loads((model_dir / "result.json").read_text())
    assert (result["step"], result["target"], result["num_replicas"], result["global_batch_size"]) == (4, "cpu", 2, 16)
    assert 0.0 <= result["eval"]["top1"] <= 1.0 and "top5" in result["eval"]
    train = mr.metrics(model_dir, "train")
    assert [r["step"] for r in train] == [2, 4]
    assert all(np.isfinite(r["loss"]) and r["examples_per_sec"] > 0 for r in train)
    # The command-line binding took effect and is recorded.
    operative = (model_dir / "operative_config.gin").read_text()
    assert "Trainer.train_steps = 4" in operative and "resnet.depth = 8" in operative
    assert "Trainer.train_steps = 4" in (model_dir / "config.gin").read_text()
    assert "step 4/4" in done.stdout and "examples/s" in done.stdout and "eta" in done.stdout


def test_one_and_two_replicas_give_the_same_losses(data_dir, tmp_path):
    losses = {}
    for n in (1, 2):
        done = mr.run([QUICKSTART], tmp_path / f"r{n}", data_dir,
                      DETERMINISTIC + (f"Replicator.num_replicas = {n}", "Trainer.log_every_steps = 1",
                                       "Trainer.steps_per_loop = 1"), extra=["--mode=train"])
        assert done.returncode == 0, done.stderr
        losses[n] = [r["loss"] for r in mr.metrics(tmp_path / f"r{n}", "train")]
    assert len(losses[1]) == 6
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5, atol=1e-6)
    assert len(set(np.round(losses[1], 6))) > 1, "losses did not change: nothing was trained"


# Slow (about 105 s): for the default suite's time limit; SIGKILL and exact resume are in the
# default tests through tests/test_stop_matrix.py's quickstart row and tests/test_recovery.py's
# chaos test (bit-identical end).
@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted(data_dir, tmp_path):
    params = DETERMINISTIC + ("Trainer.train_steps = 12", "Trainer.steps_per_loop = 1",
                              "Trainer.log_every_steps = 1", "Trainer.checkpoint_every_steps = 3")
    straight = mr.run([QUICKSTART], tmp_path / "straight", data_dir, params, extra=["--mode=train"])
    assert straight.returncode == 0, straight.stderr
    killed_dir = tmp_path / "killed"
    proc = mr.start([QUICKSTART], killed_dir, data_dir, params, extra=["--mode=train"])
    mr.wait_for_line(proc, "step 7/12")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert mr.latest_step(killed_dir) in (6, 3)
    resumed = mr.run([QUICKSTART], killed_dir, data_dir, params, extra=["--mode=train"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step" in resumed.stdout
    a, b = _weights(tmp_path / "straight"), _weights(killed_dir)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-7, err_msg=name)
    def timeless(rows):
        return [{k: v for k, v in r.items() if k != "examples_per_sec"} for r in rows]

    assert timeless(mr.metrics(killed_dir)) == timeless(mr.metrics(tmp_path / "straight"))
    assert len(mr.metrics(killed_dir, "train")) == 12


# Slow: tests/test_stop_matrix.py's quickstart row checks the same in the default suite
# (SIGTERM to the main pid: exit 0, the checkpoint at the named step, the resume).
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_rerun_resumes(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    params = mr.SMALL + mr.ONE_REPLICA + ("Trainer.train_steps = 100000", "Trainer.steps_per_loop = 1",
                                          "Trainer.log_every_steps = 1", "Trainer.checkpoint_every_steps = 100000")
    proc = mr.start([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
    mr.wait_for_line(proc, "step 3/")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out and "checkpoint saved" in out
    step = mr.latest_step(model_dir)
    assert step >= 3
    assert f"at step {step}:" in out
    assert not (model_dir / "result.json").exists()
    rerun = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=eval"])
    assert rerun.returncode == 0, rerun.stderr
    assert f"evaluating step {step} (--checkpoint=latest)" in rerun.stdout


def test_nan_loss_exits_1_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    params = mr.SMALL + mr.ONE_REPLICA + (
        "ClassificationTask.optimizer = @keras.optimizers.SGD", "keras.optimizers.SGD.learning_rate = 1e30",
        "Trainer.train_steps = 50", "Trainer.steps_per_loop = 1", "Trainer.log_every_steps = 1",
        "Trainer.checkpoint_every_steps = 1")
    done = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stderr
    assert "loss is nan" in lines[0].lower() or "loss is inf" in lines[0].lower(), done.stderr
    failed_at = int(lines[0].split("at step ")[1].split(";")[0])
    good = mr.latest_step(model_dir)
    assert good == failed_at - 1
    for name, value in _weights(model_dir).items():
        assert np.all(np.isfinite(value)), name
    assert not (model_dir / "result.json").exists()


BAD_INPUTS = [
    ("misspelt configurable", ["Trainr.train_steps = 5"], "unknown configurable 'Trainr'; did you mean 'Trainer'"),
    ("misspelt parameter", ["Trainer.train_step = 5"],
     "'Trainer' has no parameter 'train_step'; did you mean 'train_steps'"),
    ("wrong type", ["Trainer.train_steps = 'many'"], "Trainer.train_steps='many' must be a positive integer"),
    ("a float for an int, named where bound", ["Trainer.train_steps = 1e3"],
     "error: --gin_param='Trainer.train_steps = 1e3': Trainer.train_steps=1000.0 must be a positive integer"),
    ("batch not divisible", ["Trainer.global_batch_size = 15"],
     "Trainer.global_batch_size=15 is not divisible by the 2 replicas"),
    ("unknown target", ["Replicator.target = 'tpuv9'"], "Replicator.target='tpuv9' is not a known target"),
    ("gpu without a gpu", ["Replicator.target = 'gpu'"], "target='gpu' but TensorFlow sees no GPU"),
    ("bad image size", ["shapes_input.image_size = 48"], "shapes_input.image_size=48: use 32 or 64"),
    ("gin syntax error", ["Trainer.train_steps = = 3"], "--gin_param="),
    ("bad precision", ["run_experiment.precision = 'float8'"], "run_experiment.precision='float8'"),
    ("XLA on 2 CPU replicas", ["Replicator.jit_compile = True"],
     "Replicator.jit_compile=True on target 'cpu': XLA cannot compile a step that updates variables mirrored"),
    ("bad resnet depth", ["resnet.depth = 19"], "resnet.depth=19 is not a ResNet depth"),
]


# Configuration errors found while the task builds its model, optimizer and data, and
# bad flags: (what, gin file lines to drop, bindings, flags, the error line's text).
BAD_BUILDS = [
    ("task and dataset bindings missing", ("ClassificationTask.model", "ClassificationTask.dataset"), [], [],
     "error: missing binding(s) ClassificationTask.model, ClassificationTask.dataset; set them"),
    ("model binding missing", ("resnet.num_classes",), [], [], "error: missing binding(s) resnet.num_classes; set"),
    ("schedule bindings missing", (), ["Adam.learning_rate = @keras.optimizers.schedules.PiecewiseConstantDecay()"],
     [], "error: missing binding(s) PiecewiseConstantDecay.boundaries, PiecewiseConstantDecay.values; set"),
    ("wrong type in a model binding", (), ["resnet.depth = 8.0"], [],
     "error: resnet: 'float' object cannot be interpreted as an integer (bound: depth=8.0"),
    ("invalid flag value", (), [], ["--mode=evaluate"],
     "error: flag --mode=evaluate: value should be one of <train|eval|train_and_eval|continuous_eval|export>"),
    ("unknown flag", (), [], ["--modle=train"], "error: Unknown command line flag 'modle'"),
]


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(data_dir, tmp_path):
    procs = []
    for i, (_, params, _) in enumerate(BAD_INPUTS):
        procs.append(mr.start([QUICKSTART], tmp_path / f"bad{i}", data_dir, mr.SMALL + tuple(params)))
    procs.append(mr.start(["experiments/no_such.gin"], tmp_path / "badfile", data_dir))
    expected = [e for _, _, e in BAD_INPUTS] + ["--gin_file=experiments/no_such.gin: no such file"]
    with open(os.path.join(mr.ROOT, QUICKSTART), encoding="utf-8") as f:
        quickstart = f.read().splitlines()
    for i, (_, drop, params, flags, pattern) in enumerate(BAD_BUILDS):
        gin_file = tmp_path / f"build{i}.gin"
        gin_file.write_text("".join(f"{line}\n" for line in quickstart if not (drop and line.startswith(drop))))
        procs.append(mr.start([str(gin_file)], tmp_path / f"badbuild{i}", data_dir, mr.SMALL + tuple(params), flags))
        expected.append(pattern)
    for proc, pattern in zip(procs, expected, strict=True):
        out, _ = proc.communicate(timeout=300)
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, (pattern, out[-2000:])
        assert len(errors) == 1 and pattern in errors[0], (pattern, errors, out[-2000:])
        assert "Traceback" not in out
    for path in list(tmp_path.glob("bad*")):
        assert not path.exists() or not any(path.iterdir()), f"{path} was written"


def test_config_change_refused_on_resume_unless_allowed(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    params = mr.SMALL + mr.ONE_REPLICA + ("Trainer.train_steps = 2",)
    assert mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"]).returncode == 0
    before = sorted(p.name for p in model_dir.iterdir())
    changed = mr.run([QUICKSTART], model_dir, data_dir, params + ("Trainer.train_steps = 4",), extra=["--mode=train"])
    assert changed.returncode == 2 and "differs from this run's config" in changed.stderr
    assert "(now `Trainer.train_steps = 4`, was `Trainer.train_steps = 2`)" in changed.stderr
    assert sorted(p.name for p in model_dir.iterdir()) == before
    # The same configuration, spelt differently (path, spacing), resumes.
    respelt = mr.run(["./" + QUICKSTART], model_dir, data_dir, [p.replace(" = ", "=") for p in params],
                     extra=["--mode=train"])
    assert respelt.returncode == 0, respelt.stderr
    assert f"the run in {model_dir} is complete (step 2 of 2" in respelt.stdout  # accepted, and finished already
    allowed = mr.run([QUICKSTART], model_dir, data_dir, params + ("Trainer.train_steps = 4",),
                     extra=["--mode=train", "--allow_config_change"])
    assert allowed.returncode == 0, allowed.stderr
    assert mr.latest_step(model_dir) == 4


def test_config_change_compares_the_parsed_config(tmp_path, monkeypatch):
    """What a resume compares is the configuration used: path spellings do not count,
    an edit inside an included file does (in-process: config.parse + the check)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments" / "targets").mkdir(parents=True)
    included = tmp_path / "experiments" / "targets" / "steps.gin"
    included.write_text("Trainer.train_steps = 2\n")
    (tmp_path / "experiments" / "x.gin").write_text(
        "include 'experiments/targets/steps.gin'\nTrainer.global_batch_size = 16\n")
    model_dir = str(tmp_path / "run")

    def check(path, *params):
        text = config.parse([path], list(params))
        experiment._check_config_unchanged(model_dir, text, gin.config_str())  # pylint: disable=protected-access
        return text

    RunFiles(model_dir).start(check("./experiments/x.gin"), 0, gin.config_str())
    check("experiments/x.gin")
    check(os.path.join(str(tmp_path), "experiments", "x.gin"), "Trainer.train_steps=2")
    included.write_text("Trainer.train_steps = 3\n")
    with pytest.raises(ConfigError, match=r"parsed_config.gin differs from this run's config "
                                          r"\(now `Trainer.train_steps = 3`, was `Trainer.train_steps = 2`\)"):
        check("./experiments/x.gin")
    gin.clear_config()
