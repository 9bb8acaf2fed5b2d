"""The trainer through main.py: accumulation counts optimizer updates (issue 9, item 4);
unreadable checkpoints (item 2) and a torn metrics line (item 11) on resume.

One shapes run with `wrap_optimizer.accumulate_steps = 2` (checkpoints at steps 2
and 4) is shared; each test damages its own copy."""

import json
import os
import re
import shutil
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

import expframe as xf
from expframe.run_files import RunFiles
from expframe.tasks.base import StopRequested, Task
from expframe.trainer import Trainer, progress_line
from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
PARAMS = mr.SMALL + ("Trainer.train_steps = 4", "Trainer.checkpoint_every_steps = 2",
                     "wrap_optimizer.accumulate_steps = 2", "run_experiment.deterministic = True")


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("accumulate") / "run"
    done = mr.run([QUICKSTART], model_dir, data_dir, PARAMS, extra=["--mode=train"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return model_dir


def _copy(model_dir, tmp_path):
    shutil.copytree(model_dir, tmp_path / "run")
    return tmp_path / "run"


def _variables(checkpoint):
    """The checkpoint's counters: the trainer's step, the optimizers' iterations, micro-steps."""
    reader = tf.train.load_checkpoint(str(checkpoint))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith("step/") or "iterations/" in name or "micro_step" in name}


def _snapshot(model_dir):
    return {str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


def test_accumulate_steps_counts_optimizer_updates(trained):
    assert "wrap_optimizer.accumulate_steps = 2" in (trained / "operative_config.gin").read_text()
    assert [r["step"] for r in mr.metrics(trained, "train")] == [2, 4]
    assert all(r["examples_per_sec"] > 0 for r in mr.metrics(trained, "train"))
    for step in (2, 4):  # the trainer's step, the optimizer's updates and the file name agree
        values = _variables(trained / "checkpoints" / f"ckpt-{step}")
        iterations = [v for n, v in values.items()
                      if n.startswith("optimizer/") and n.endswith("iterations/.ATTRIBUTES/VARIABLE_VALUE")]
        assert [int(v) for v in iterations] == [step], sorted(values)
        assert int(values["step/.ATTRIBUTES/VARIABLE_VALUE"]) == step
        micro = [v for n, v in values.items() if "micro_step" in n]
        assert [int(v) for v in micro] in ([], [2 * step])  # where the optimizer keeps a micro-batch count


def test_unreadable_checkpoints_exit_1_naming_them_and_change_nothing(trained, data_dir, tmp_path):
    model_dir = _copy(trained, tmp_path)
    for step, cut in ((4, 10), (2, 100)):
        with open(model_dir / "checkpoints" / f"ckpt-{step}.data-00000-of-00001", "r+b") as f:
            f.truncate(cut)
    before = _snapshot(model_dir)
    done = mr.run([QUICKSTART], model_dir, data_dir, PARAMS, extra=["--mode=train"])
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "cannot read any checkpoint in" in errors[0] and "ckpt-4 (" in errors[0] and "ckpt-2 (" in errors[0]
    assert "Nothing was deleted" in errors[0]
    assert _snapshot(model_dir) == before  # metrics.jsonl, checkpoints, config: untouched


def test_resume_falls_back_to_a_readable_checkpoint_and_drops_a_torn_metrics_line(trained, data_dir, tmp_path):
    model_dir = _copy(trained, tmp_path)
    with open(model_dir / "checkpoints" / "ckpt-4.data-00000-of-00001", "r+b") as f:
        f.truncate(10)
    metrics = (model_dir / "metrics.jsonl").read_text()
    (model_dir / "metrics.jsonl").write_text(metrics[:-25])  # killed while writing the step-4 record
    done = mr.run([QUICKSTART], model_dir, data_dir, PARAMS, extra=["--mode=train"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "could not read the newer checkpoint(s) ckpt-4 (" in done.stdout
    assert "restored the older ckpt-2 (step 2) instead" in done.stdout and "resuming from step 2" in done.stdout
    assert "dropped the torn last line 3 of" in done.stdout  # after the provenance record and step 2
    assert [r["step"] for r in mr.metrics(model_dir, "train")] == [2, 4]
    assert [r["step"] for r in mr.metrics(model_dir, "provenance")] == [0, 2]  # one per start
    values = _variables(model_dir / "checkpoints" / "ckpt-4")
    assert int(values["step/.ATTRIBUTES/VARIABLE_VALUE"]) == 4
    # Steps 3-4 were redone from step 2 exactly as the first run did them.
    first = json.loads(metrics.splitlines()[2])
    again = mr.metrics(model_dir, "train")[1]
    np.testing.assert_allclose(again["loss"], first["loss"], rtol=1e-5)
    assert os.path.exists(model_dir / "result.json")


class TwoOptimizers(Task):
    """A GAN-like task: two wrapped optimizers, accumulating k_g and k_d micro-batches."""

    def __init__(self, k_g, k_d):
        self.k_g, self.k_d = k_g, k_d

    def build(self):
        self.generator = xf.wrap_optimizer(keras.optimizers.SGD(0.1), accumulate_steps=self.k_g)
        self.discriminator = xf.wrap_optimizer(keras.optimizers.SGD(0.1), accumulate_steps=self.k_d)

    def train_input_fn(self, ctx):
        return tf.data.Dataset.from_tensors({"x": tf.zeros([1])}).repeat()

    def trackables(self):
        return {"optimizers": {"generator": self.generator, "discriminator": self.discriminator}}


def test_the_task_optimizers_must_accumulate_alike():
    trainer = Trainer(train_steps=1, global_batch_size=2)
    trainer.prepare(xf.Replicator("cpu", 1), TwoOptimizers(3, 3), seed=0, deterministic=False)
    assert trainer.accumulate_steps == 3
    with pytest.raises(xf.ConfigError, match=r"TwoOptimizers's optimizers accumulate different numbers of "
                                             r"micro-batches per update \(wrap_optimizer.accumulate_steps: "
                                             r"optimizers.discriminator 1, optimizers.generator 2\)"):
        Trainer(train_steps=1, global_batch_size=2).prepare(
            xf.Replicator("cpu", 1), TwoOptimizers(2, 1), seed=0, deterministic=False)


class CountedSteps(Task):
    """One dense layer on constant data; counts the Python calls of train_step (traces)."""

    def build(self):
        self.traced = 0
        self.layer = keras.layers.Dense(1)
        self.layer.build((None, 2))
        self.optimizer = xf.wrap_optimizer(keras.optimizers.SGD(0.1))
        self.optimizer.build(self.layer.trainable_variables)

    def train_input_fn(self, ctx):
        return tf.data.Dataset.from_tensors({"x": tf.ones([2])}).repeat().batch(ctx.get_per_replica_batch_size(2))

    def train_step(self, batch):
        self.traced += 1
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self.layer(batch["x"]) ** 2)
        self.optimizer.minimize(loss, self.layer.trainable_variables, tape)
        return {"loss": loss}

    def trackables(self):
        return {"layer": self.layer, "optimizer": self.optimizer}


def test_the_first_host_call_reuses_the_trace_made_before_writing():
    # run_experiment traces the step before it writes anything (Trainer.trace); the host
    # calls after it must not trace it again (they did: a second full trace of every
    # run), and the host loop traces it once (it did twice: before the loop and in it).
    trainer = Trainer(train_steps=4, global_batch_size=2, steps_per_loop=2)
    task = CountedSteps()
    trainer.prepare(xf.Replicator("cpu", 1), task, seed=0, deterministic=False)
    trainer.trace()
    assert task.traced == 1  # once: the loop's first step and its body share one trace
    first, second = trainer.run_train_steps(2), trainer.run_train_steps(2)
    assert task.traced == 1
    assert second["loss"] < first["loss"]


class NamedMetrics(CountedSteps):
    """CountedSteps whose step also returns `accuracy`, with a host-side `env_steps` after each call."""

    def train_step(self, batch):
        return dict(super().train_step(batch), accuracy=tf.constant(0.25))

    def after_train_steps(self, step):
        return {"env_steps": 1000.0 * step}


def test_progress_lines_show_the_task_metrics_under_its_names(tmp_path, capsys):
    # The extending guide says train metrics appear "under the names you give them"; the
    # progress line showed only `loss` (issue 31).
    trainer = Trainer(train_steps=4, global_batch_size=2, steps_per_loop=2, log_every_steps=2)
    trainer.prepare(xf.Replicator("cpu", 1), NamedMetrics(), seed=0, deterministic=False)
    out = RunFiles(str(tmp_path / "run"))
    trainer.restore(out.checkpoint_dir)
    out.start("", 0)
    try:
        trainer.train(out, evaluate=False)
    finally:
        out.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    # The loss is 4 decimals, or 4 significant digits under 1e-3 (0.0002757, 1.234e-05), less
    # trailing zeros (3.12e-05 for 3.120e-05: seen once the loss fell on one).
    loss = r"(\d\.\d{4}|0\.000\d{1,4}|\d(\.\d{1,3})?e-\d\d)"
    assert re.match(rf"step 4/4  loss {loss}  accuracy 0\.2500  env_steps 4000\.0000  [\d,.]+ examples/s  "
                    r"eta 0:00:00$", lines[-1]), lines
    records = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if r["split"] == "train"]
    assert records[-1]["accuracy"] == 0.25 and records[-1]["env_steps"] == 4000.0


class WaitsForActors(CountedSteps):
    """Before step 2's host call it is signalled (SIGTERM) while it waits, as a learner
    waiting for starting actor processes is, and gives up the wait (`StopRequested`)."""

    def before_train_steps(self, step, num_steps):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)   # the trainer's handler notes it
            raise StopRequested("signalled while waiting for the actors")


def test_a_stop_signal_while_the_task_waits_checkpoints_the_step_reached_and_exits_0(tmp_path, capsys):
    trainer = Trainer(train_steps=8, global_batch_size=2, steps_per_loop=2, log_every_steps=2,
                      checkpoint_every_steps=100)
    trainer.prepare(xf.Replicator("cpu", 1), WaitsForActors(), seed=0, deterministic=False)
    out = RunFiles(str(tmp_path / "run"))
    trainer.restore(out.checkpoint_dir)
    out.start("", 0)
    try:
        result = trainer.train(out, evaluate=False)
    finally:
        out.close()
    assert result == {"preempted": True, "step": 2}
    assert "received SIGTERM at step 2: checkpoint saved; rerun the same command to resume" in capsys.readouterr().out
    resumed = Trainer(train_steps=8, global_batch_size=2, steps_per_loop=2, log_every_steps=2,
                      checkpoint_every_steps=100)
    resumed.prepare(xf.Replicator("cpu", 1), CountedSteps(), seed=0, deterministic=False)
    resumed.restore(out.checkpoint_dir)
    assert int(resumed.step.numpy()) == 2
    # Without a signal the trainer does not swallow the task's StopRequested.
    bare = Trainer(train_steps=8, global_batch_size=2, steps_per_loop=2, log_every_steps=2)
    task = WaitsForActors()
    task.before_train_steps = lambda step, num: (_ for _ in ()).throw(StopRequested("no signal"))
    bare.prepare(xf.Replicator("cpu", 1), task, seed=0, deterministic=False)
    other = RunFiles(str(tmp_path / "bare"))
    bare.restore(other.checkpoint_dir)
    other.start("", 0)
    try:
        with pytest.raises(StopRequested, match="no signal"):
            bare.train(other, evaluate=False)
    finally:
        other.close()


def test_progress_line_numbers():
    line = progress_line(3, 10, {"g_loss": 1.5e-5, "loss": 0.5, "fid": 123456.0}, 1234.5, 61)
    assert line == "step 3/10  loss 0.5000  g_loss 1.5e-05  fid 1.235e+05  1,234.5 examples/s  eta 0:01:01"
