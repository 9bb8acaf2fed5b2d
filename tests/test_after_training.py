"""After training (docs/after_training.md): the best checkpoint, profiles, fine-tuning
from another run, and continuous evaluation beside a trainer, through main.py."""

import glob
import json
import os
import re
import shutil
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from expframe import continuous_eval, dir_lock, init_checkpoint
from expframe.errors import ConfigError
from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
# 6 steps, an evaluation and a checkpoint every 2, only the newest checkpoint kept: the
# best one lives on in best/ whatever the trainer prunes. A profile of steps 3 and 4.
SOURCE = mr.SMALL + mr.ONE_REPLICA + (
    "run_experiment.deterministic = True", "Trainer.eval_every_steps = 2", "Trainer.checkpoint_every_steps = 2",
    "Trainer.max_checkpoints = 1", "Trainer.best_checkpoint = ('top1', 'max')", "Trainer.profile_steps = (3, 4)",
    "ClassificationTask.evaluations = {'eval_train': 'train'}")
TWELVE = ("resnet.num_classes = 12", "run_experiment.init_checkpoint = '{source}'")


@pytest.fixture(scope="module")
def source(data_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("after") / "source"
    done = mr.run([QUICKSTART], model_dir, data_dir, SOURCE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return model_dir, done.stdout


def _model_variables(path):
    names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    return sorted(n for n in names if n.startswith("model/") and n.endswith("VARIABLE_VALUE"))


def _errors(done):
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def _scalar_steps(folder, tag):
    """The steps of TensorBoard scalar `tag` in the event files of `folder`, in file order."""
    steps = []
    for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


# -- the best checkpoint ---------------------------------------------------------------

def test_the_best_checkpoint_is_the_best_evaluation_and_outlives_pruning(source):
    model_dir, out = source
    evals = mr.metrics(model_dir, "eval")
    assert [r["step"] for r in evals] == [2, 4, 6]
    best = json.loads((model_dir / "best" / "best.json").read_text())
    top = max(r["top1"] for r in evals)
    first_top = next(r for r in evals if r["top1"] == top)  # a tie keeps the earlier step
    assert (best["step"], best["metric"], best["mode"], best["value"]) == (first_top["step"], "top1", "max", top)
    assert best["eval"] == {k: v for k, v in first_top.items() if k not in ("step", "split")}
    assert [r["step"] for r in mr.metrics(model_dir, "eval_train")] == [2, 4, 6]  # a named evaluation, apart
    assert _scalar_steps(model_dir / "eval_train", "top1") == [2, 4, 6] and "eval_train at step 6: " in out
    assert sorted(os.listdir(model_dir / "best")) == ["best.json", f"ckpt-{best['step']}.data-00000-of-00001",
                                                      f"ckpt-{best['step']}.index"]
    assert [f for f in os.listdir(model_dir / "checkpoints") if f.endswith(".index")] == ["ckpt-6.index"]
    assert f"best checkpoint: step {best['step']}, top1" in out


def test_an_on_demand_eval_of_an_older_checkpoint_is_recorded_apart_and_gives_its_numbers(
        source, data_dir, tmp_path):
    model_dir = tmp_path / "copy"
    shutil.copytree(source[0], model_dir)
    best = json.loads((model_dir / "best" / "best.json").read_text())
    curves = [(r["split"], r["step"]) for r in mr.metrics(model_dir) if r["split"].startswith("eval")]
    before = (model_dir / "config.gin").stat().st_mtime_ns
    done = mr.run([QUICKSTART], model_dir, data_dir, SOURCE, extra=["--mode=eval", "--checkpoint=best"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"evaluating step {best['step']} (--checkpoint=best)" in done.stdout and "resuming" not in done.stdout
    assert "Using custom data configuration" not in done.stdout + done.stderr  # TFDS's notice of shapes' config
    records = mr.metrics(model_dir, "on_demand")
    assert [(r["evaluation"], r["step"], r["checkpoint"]) for r in records] == [
        ("eval", best["step"], "best"), ("eval_train", best["step"], "best")]
    np.testing.assert_allclose([records[0][k] for k in sorted(best["eval"])],
                               [best["eval"][k] for k in sorted(best["eval"])], rtol=1e-6)
    # The run's curves are untouched: one record per step, in order, in metrics.jsonl and TensorBoard.
    assert [(r["split"], r["step"]) for r in mr.metrics(model_dir) if r["split"].startswith("eval")] == curves
    assert [r["step"] for r in mr.metrics(model_dir, "eval")] == [2, 4, 6]
    assert [r["step"] for r in mr.metrics(model_dir, "eval_train")] == [2, 4, 6]
    assert _scalar_steps(model_dir / "eval", "top1") == [2, 4, 6]
    assert _scalar_steps(model_dir / "eval_train", "top1") == [2, 4, 6]
    assert _scalar_steps(model_dir / "on_demand", "eval_train/top1") == [best["step"]]
    assert (model_dir / "config.gin").stat().st_mtime_ns == before  # a reader rewrites nothing
    assert len(mr.metrics(model_dir, "provenance")) == len(mr.metrics(source[0], "provenance"))
    # One evaluation by name; an unknown name is one line, exit 2.
    one = mr.run([QUICKSTART], model_dir, data_dir, SOURCE, extra=["--mode=eval", "--evaluation=eval_train"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert [r["evaluation"] for r in mr.metrics(model_dir, "on_demand")][2:] == ["eval_train"]
    bad = mr.run([QUICKSTART], model_dir, data_dir, SOURCE, extra=["--mode=eval", "--evaluation=eval_tran"])
    assert bad.returncode == 2 and _errors(bad) == [
        "error: --evaluation='eval_tran': this run's evaluations are eval, eval_train (named ones are bound as "
        "ClassificationTask.evaluations)."], bad.stderr[-2000:]


def test_rerunning_a_finished_run_writes_nothing_and_says_it_is_complete(source, data_dir, tmp_path):
    model_dir = tmp_path / "copy"
    shutil.copytree(source[0], model_dir)
    files = {p: (os.stat(p).st_mtime_ns, os.path.getsize(p)) for p in glob.glob(str(model_dir / "**"), recursive=True)}
    again = mr.run([QUICKSTART], model_dir, data_dir, SOURCE)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the run in {model_dir} is complete (step 6 of 6, result.json): nothing to do" in again.stdout
    assert {p: (os.stat(p).st_mtime_ns, os.path.getsize(p))
            for p in glob.glob(str(model_dir / "**"), recursive=True)} == files


# -- profiles --------------------------------------------------------------------------

def test_the_profile_traces_the_train_step(source):
    model_dir, out = source
    traces = [os.path.join(d, f) for d, _, files in os.walk(model_dir / "train" / "plugins" / "profile")
              for f in files if f.endswith(".xplane.pb")]
    assert len(traces) == 1, traces
    with open(traces[0], "rb") as f:
        data = f.read()
    assert b"Conv2D" in data and b"__inference" in data  # ops of the ResNet's traced train step
    assert "profiling train steps 3 to 4" in out and "profile written at step 4" in out


# -- fine-tuning -----------------------------------------------------------------------

def test_a_12_class_run_starts_from_the_10_class_run_but_its_head(source, data_dir, tmp_path):
    model_dir = tmp_path / "twelve"
    params = SOURCE + tuple(p.format(source=source[0]) for p in TWELVE) + (
        "run_experiment.init_exclude = ['model/logits']", "Trainer.train_steps = 2", "Trainer.profile_steps = None",
        "Trainer.best_checkpoint = None")
    done = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("init_checkpoint:"))
    restored = len(_model_variables(str(source[0] / "checkpoints" / "ckpt-6"))) - 2  # all but logits' kernel, bias
    assert f"restored {restored} variable(s) from {source[0]}/checkpoints/ckpt-6 (model {restored})" in line, line
    assert "2 excluded by run_experiment.init_exclude (model 2: model/logits/bias, model/logits/kernel)" in line
    assert re.search(r"\d+ not in run_experiment.init_include \(optimizer \d+\)", line), line
    # A rerun resumes from its own checkpoint: no init_checkpoint line.
    again = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
    assert again.returncode == 0 and "init_checkpoint:" not in again.stdout, again.stdout[-2000:]


@pytest.mark.parametrize("extra, message", [
    (("run_experiment.init_include = ['model/no_such_layer']",),
     "error: run_experiment.init_include entry 'model/no_such_layer' matches no variable"),
    ((), "error: run_experiment.init_checkpoint: model/logits/bias has shape (10,) in"),
])
def test_a_bad_name_or_shape_is_one_line_exit_2_and_nothing_written(source, data_dir, tmp_path, extra, message):
    model_dir = tmp_path / "refused"
    params = SOURCE + tuple(p.format(source=source[0]) for p in TWELVE) + extra
    done = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(_errors(done)) == 1 and _errors(done)[0].startswith(message), done.stderr[-2000:]
    assert not model_dir.exists()


def test_restore_takes_the_chosen_variables_with_their_values(tmp_path):
    def net(classes):
        keras.utils.set_random_seed(classes)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="body"),
                                 keras.layers.Dense(classes, name="head")], name="net")

    source, optimizer = net(10), keras.optimizers.Adam()
    optimizer.build(source.trainable_variables)
    path = tf.train.Checkpoint(model=source, optimizer=optimizer).write(str(tmp_path / "ckpt-1"))
    target, target_optimizer = net(12), keras.optimizers.Adam()
    target_optimizer.build(target.trainable_variables)
    fresh_head = target.get_layer("head").kernel.numpy()
    report = init_checkpoint.restore({"model": target, "optimizer": target_optimizer}, path,
                                     exclude=["model/net/head"])
    assert report["restored"] == ["model/net/body/bias", "model/net/body/kernel"]  # a Sequential's paths hold its name
    assert report["excluded"] == ["model/net/head/bias", "model/net/head/kernel"]
    assert len(report["not_selected"]) == len(target_optimizer.variables)
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(getattr(target.get_layer("body"), name).numpy(),
                                      getattr(source.get_layer("body"), name).numpy())
    np.testing.assert_array_equal(target.get_layer("head").kernel.numpy(), fresh_head)
    with pytest.raises(ConfigError, match="init_exclude entry 'model/tail' matches no variable"):
        init_checkpoint.restore({"model": target}, path, exclude=["model/tail"])
    with pytest.raises(ConfigError, match=r"model/net/head/bias has shape \(10,\) in .* and \(12,\) in this task"):
        init_checkpoint.restore({"model": target}, path)
    with pytest.raises(ConfigError, match="no checkpoint there"):
        init_checkpoint.restore({"model": target}, str(tmp_path / "nothing"))


# -- continuous evaluation -------------------------------------------------------------

# A trainer that checkpoints every 20 steps and keeps them all, so every checkpoint is
# there to be evaluated; no evaluation of its own (--mode=train).
BESIDE = mr.SMALL + mr.ONE_REPLICA + (
    "Trainer.train_steps = 200", "Trainer.steps_per_loop = 10", "Trainer.log_every_steps = 20",
    "Trainer.checkpoint_every_steps = 20", "Trainer.max_checkpoints = 100")


def test_continuous_evaluation_beside_a_trainer_evaluates_each_checkpoint_once(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    evaluate = ["--mode=continuous_eval", "--eval_timeout_s=300"]
    first = mr.start([QUICKSTART], model_dir, data_dir, BESIDE, extra=evaluate)  # before the trainer: it waits
    trainer = mr.start([QUICKSTART], model_dir, data_dir, BESIDE, extra=["--mode=train"])
    try:
        mr.wait_for_line(first, "eval at step ")
        first.send_signal(signal.SIGKILL)  # mid-run: the restart neither repeats nor skips a step
        first.wait(60)
        second = mr.start([QUICKSTART], model_dir, data_dir, BESIDE, extra=evaluate)
        trained, _ = trainer.communicate(timeout=400)
        evaluated, _ = second.communicate(timeout=400)
    finally:
        for proc in (first, trainer):
            if proc.poll() is None:
                proc.kill()
    assert trainer.returncode == 0, trained[-3000:]
    assert second.returncode == 0, evaluated[-3000:]
    steps = [r["step"] for r in mr.metrics(model_dir, "eval")]
    assert steps == list(range(20, 201, 20)), steps
    assert "skipped" not in evaluated
    # The same numbers as --mode=eval of that checkpoint (recorded apart).
    done = mr.run([QUICKSTART], model_dir, data_dir, BESIDE, extra=["--mode=eval", "--checkpoint=100"])
    assert done.returncode == 0, done.stderr[-3000:]
    once, again = mr.metrics(model_dir, "eval")[4], mr.metrics(model_dir, "on_demand")[-1]
    assert once["step"] == again["step"] == 100
    assert {k: v for k, v in once.items() if k != "split"} == {
        k: v for k, v in again.items() if k not in ("split", "evaluation", "checkpoint")}
    # Every train record once: the trainer kept the evaluator's records and its own.
    assert [r["step"] for r in mr.metrics(model_dir, "train")] == list(range(20, 201, 20))


def test_an_evaluator_slower_than_a_trainer_that_keeps_one_checkpoint_ends_at_its_final_step(data_dir, tmp_path):
    """The pruning race for real (tests/test_continuous_eval_race.py forces it in one
    process): a checkpoint every 2 steps, only the newest kept."""
    model_dir = tmp_path / "run"
    params = BESIDE + ("Trainer.train_steps = 40", "Trainer.steps_per_loop = 2", "Trainer.checkpoint_every_steps = 2",
                       "Trainer.max_checkpoints = 1")
    evaluator = mr.start([QUICKSTART], model_dir, data_dir, params, extra=["--mode=continuous_eval",
                                                                            "--eval_timeout_s=300"])
    trained = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
    evaluated, _ = evaluator.communicate(timeout=400)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert evaluator.returncode == 0, evaluated[-3000:]
    steps = [r["step"] for r in mr.metrics(model_dir, "eval")]
    assert steps == sorted(set(steps)) and steps[-1] == 40, steps
    skips = [line for line in evaluated.splitlines() if "skipped" in line]
    assert all(line.startswith("continuous evaluation: skipped step") for line in skips), skips
    assert not os.path.exists(model_dir / ".evaluating")
    assert "Using custom data configuration" not in evaluated + trained.stderr


def test_an_evaluator_without_checkpoints_stops_after_its_timeout(data_dir, tmp_path):
    model_dir = tmp_path / "empty"
    done = mr.run([QUICKSTART], model_dir, data_dir, BESIDE, extra=["--mode=continuous_eval", "--eval_timeout_s=1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "continuous evaluation: no new checkpoint in 1 s after step 0; stopped" in done.stdout
    assert sorted(os.listdir(model_dir)) == [dir_lock.EVALUATOR, "metrics.jsonl"]  # its provenance record only
    assert [r["split"] for r in mr.metrics(model_dir)] == []


def test_one_evaluator_per_model_dir(tmp_path):
    path = str(tmp_path / dir_lock.EVALUATOR)
    held = dir_lock.hold(path)
    assert held is not None and dir_lock.hold(path) is None and dir_lock.is_held(path)
    assert dir_lock.holder(path).startswith(f"pid {os.getpid()} on host ")
    held.release()
    assert not dir_lock.is_held(path)


def test_the_skipped_steps_are_the_periodic_ones_before_the_first_checkpoint_left():
    assert continuous_eval.skipped_steps(0, 8, 2) == [2, 4, 6]
    assert continuous_eval.skipped_steps(4, 6, 2) == []
    assert continuous_eval.skipped_steps(5, 37, 10) == [10, 20, 30]  # 37: a checkpoint on a stop signal
