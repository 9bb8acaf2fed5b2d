"""Epochs (issue 51, item 3) and a run's wall time over its segments (item 5).

A run of `Trainer.train_epochs`, its cadences in epochs too, stopped by SIGTERM and
resumed, takes the same steps, losses and final evaluation as the uninterrupted run
of the same length in `Trainer.train_steps`; its result.json sums the two segments'
wall times. The arithmetic (expframe/epochs.py) and the refusals are checked in-process.
"""

import json
import signal

import numpy as np
import pytest
import tensorflow as tf

from expframe import epochs, run_files
from expframe.errors import ConfigError
from expframe.replicator import Replicator
from expframe.run_files import RunFiles
from expframe.tasks.base import Task
from expframe.trainer import Trainer
from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
# The small shapes build holds 512 train examples: at a global batch of 16 an epoch is 32 steps.
COMMON = mr.SMALL + mr.ONE_REPLICA + ("run_experiment.deterministic = True", "Trainer.log_every_steps = 2")
IN_STEPS = COMMON + ("Trainer.train_steps = 64", "Trainer.eval_every_steps = 32", "Trainer.checkpoint_every_steps = 16")
IN_EPOCHS = COMMON + ("Trainer.train_steps = None", "Trainer.train_epochs = 2", "Trainer.eval_every_steps = None",
                      "Trainer.eval_every_epochs = 1", "Trainer.checkpoint_every_steps = None",
                      "Trainer.checkpoint_every_epochs = 0.5")


def test_epoch_arithmetic():
    assert epochs.steps_per_epoch(512, 16, "T") == 32
    assert epochs.steps_per_epoch(1000, 64, "T") == 15  # rounded down: the stream is endless
    assert epochs.steps("Trainer.train_epochs", 2, 15) == 30
    assert epochs.steps("Trainer.train_epochs", 0.29, 100) == 29  # 0.29 x 100 = 28.999999999999996
    assert epochs.steps("Trainer.eval_every_epochs", 0.5, 15) == 7
    assert epochs.epoch_at(45, 15) == 3.0 and epochs.epoch_at(7, 14) == 0.5
    with pytest.raises(ConfigError, match=r"^Trainer.eval_every_epochs=0.01 is less than one step \(an epoch is "
                                          r"15 steps\); use at least 0.06667\.$"):
        epochs.steps("Trainer.eval_every_epochs", 0.01, 15)
    with pytest.raises(ConfigError, match="T's train split holds 10 examples, fewer than one step consumes"):
        epochs.steps_per_epoch(10, 16, "T")
    with pytest.raises(ConfigError, match=r"^Trainer.train_epochs \(or another binding in epochs\) needs the size of "
                                          r"the train data, but T does not know it"):
        epochs.steps_per_epoch(None, 16, "T")


@pytest.mark.parametrize("bindings, message", [
    (dict(train_steps=100, train_epochs=2), "Trainer.train_steps=100 and Trainer.train_epochs=2 are both bound"),
    (dict(), "Trainer.train_steps and Trainer.train_epochs are both unbound: bind one of them"),
    (dict(train_steps=10, eval_every_steps=5, eval_every_epochs=1),
     "Trainer.eval_every_steps=5 and Trainer.eval_every_epochs=1 are both bound"),
    (dict(train_epochs=0), r"Trainer.train_epochs=0 must be a positive number of epochs"),
    (dict(train_epochs="2"), r"Trainer.train_epochs='2' must be a positive number of epochs"),
    (dict(train_steps=1e3), r"Trainer.train_steps=1000.0 must be a positive integer or None \(write 1000: gin reads "
                            r"1e3 or 1000.0 as a float\)\."),
])
def test_steps_or_epochs_one_of_each(bindings, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(global_batch_size=4, **bindings)


class Endless(Task):
    """A task whose train data has no size (a generated stream): Task.train_examples is None."""

    def build(self):
        self.w = tf.Variable(1.0)

    def train_input_fn(self, ctx):
        return tf.data.Dataset.from_tensors({"x": tf.ones([2])}).repeat()

    def trackables(self):
        return {"w": self.w}


class Sized(Endless):
    def train_examples(self):
        return 100


def test_train_epochs_needs_the_train_data_size():
    with pytest.raises(ConfigError, match="needs the size of the train data, but Endless does not know it"):
        Trainer(train_epochs=2, global_batch_size=4).prepare(Replicator("cpu", 1), Endless(), 0, False)
    plain = Trainer(train_steps=3, global_batch_size=4)  # no binding in epochs: no epoch, no refusal
    plain.prepare(Replicator("cpu", 1), Endless(), 0, False)
    assert plain.steps_per_epoch is None and plain.resolved_steps == {}
    sized = Trainer(train_epochs=1.5, checkpoint_every_epochs=0.5, global_batch_size=4, profile_steps=(2, 37))
    sized.prepare(Replicator("cpu", 1), Sized(), 0, False)
    assert (sized.steps_per_epoch, sized.train_steps, sized.checkpoint_every_steps) == (25, 37, 12)
    assert sized.resolved_steps == {"Trainer.train_steps": 37, "Trainer.checkpoint_every_steps": 12}
    assert sized.eval_every_steps is None and sized.profile_steps == (2, 37)
    with pytest.raises(ConfigError, match=r"Trainer.profile_steps=\(2, 38\) must be .* <= Trainer.train_steps \(37\)"):
        Trainer(train_epochs=1.5, global_batch_size=4, profile_steps=(2, 38)).prepare(
            Replicator("cpu", 1), Sized(), 0, False)


def _timeless(rows):
    return [{k: v for k, v in r.items() if k != "examples_per_sec"} for r in rows]


def test_train_epochs_stopped_and_resumed_equals_train_steps(data_dir, tmp_path):
    straight_dir, epochs_dir = tmp_path / "steps", tmp_path / "epochs"
    straight = mr.start([QUICKSTART], straight_dir, data_dir, IN_STEPS, extra=["--mode=train_and_eval"])
    stopped = mr.start([QUICKSTART], epochs_dir, data_dir, IN_EPOCHS, extra=["--mode=train_and_eval"])
    first = "".join(mr.wait_for_line(stopped, "step 2/64  epoch 0.06  loss "))
    stopped.send_signal(signal.SIGTERM)
    out, _ = stopped.communicate(timeout=240)
    assert stopped.returncode == 0, first + out
    assert "global batch 16, 64 steps (2 epochs of 32 steps)" in first
    assert "received SIGTERM" in out and not (epochs_dir / "result.json").exists()
    stopped_at = mr.latest_step(epochs_dir)
    assert 2 <= stopped_at < 64
    resumed = mr.run([QUICKSTART], epochs_dir, data_dir, IN_EPOCHS, extra=["--mode=train_and_eval"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from step {stopped_at}" in resumed.stdout
    done, _ = straight.communicate(timeout=240)
    assert straight.returncode == 0, done[-3000:]

    # The same steps, epochs, losses and evaluations as the run in steps.
    steps, in_epochs = mr.metrics(straight_dir), mr.metrics(epochs_dir)
    assert [(r["step"], r["split"]) for r in in_epochs] == [(r["step"], r["split"]) for r in steps]
    assert [r["step"] for r in in_epochs if r["split"] == "eval"] == [32, 64]
    assert [r["epoch"] for r in in_epochs if r["split"] == "train"] == [s / 32 for s in range(2, 65, 2)]
    for a, b in zip(_timeless(steps), _timeless(in_epochs), strict=True):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([b[k] for k in sorted(b) if k != "split"],
                                   [a[k] for k in sorted(a) if k != "split"], rtol=1e-5)
    kept = {int(p.name[len("ckpt-"):-len(".index")]) for p in (epochs_dir / "checkpoints").glob("ckpt-*.index")}
    assert {48, 64} <= kept and all(s % 16 == 0 for s in kept - {stopped_at})  # every 0.5 epochs: 16 steps
    resolved = json.loads((epochs_dir / "resolved.json").read_text())
    assert {k: resolved[k] for k in resolved if k.startswith("Trainer.")} == {
        "Trainer.train_steps": 64, "Trainer.eval_every_steps": 32, "Trainer.checkpoint_every_steps": 16}

    # result.json: the whole run's wall time is the sum of its two segments.
    result = json.loads((epochs_dir / "result.json").read_text())
    straight_result = json.loads((straight_dir / "result.json").read_text())
    assert result["eval"] == pytest.approx(straight_result["eval"], rel=1e-5)
    segments = json.loads((epochs_dir / "segments.json").read_text())["segments"]
    assert [(s["from_step"], s["to_step"]) for s in segments] == [(0, stopped_at), (stopped_at, 64)]
    durations = [s["end"] - s["start"] for s in segments]
    assert result["segments"] == 2 and straight_result["segments"] == 1
    assert result["wall_time_s"] == pytest.approx(sum(durations), abs=2e-3)
    assert result["wall_time_last_segment_s"] == pytest.approx(durations[1], abs=2e-3)
    assert result["wall_time_first_start_to_end_s"] == pytest.approx(segments[1]["end"] - segments[0]["start"],
                                                                      abs=2e-3)
    # The pause between the segments (the second process's start-up) counts in the span only.
    assert result["wall_time_first_start_to_end_s"] > result["wall_time_s"] > result["wall_time_last_segment_s"] > 0


def test_a_resume_that_counts_other_steps_is_refused(tmp_path):
    run_files.write_json(str(tmp_path / run_files.RESOLVED), {"Trainer.train_steps": 64})
    run_files.check_resolved(str(tmp_path), {"Trainer.train_steps": 64})
    with pytest.raises(ConfigError, match=r"resolved.json: Trainer.train_epochs comes to Trainer.train_steps = 70 in "
                                          r"this run, but the run in .* was trained with 64 \(the train data's size "
                                          r"changed\); bind Trainer.train_steps = 64 in its place"):
        run_files.check_resolved(str(tmp_path), {"Trainer.train_steps": 70})


def test_segments_are_kept_across_starts_and_reset_by_a_new_run(tmp_path, monkeypatch):
    clock = iter([100.0, 100.0, 130.0, 200.0, 200.0, 210.0, 215.0, 300.0, 300.0, 301.0])
    monkeypatch.setattr(run_files.time, "time", lambda: next(clock))
    first = RunFiles(str(tmp_path))
    first.start("config", 0)                     # 100
    first.record_segment(4)                      # 130: a checkpoint, then killed
    resumed = RunFiles(str(tmp_path))
    resumed.start("config", 4)                   # 200
    resumed.record_segment(8)                    # 210
    assert resumed.finish_segment(8) == {"wall_time_s": 45.0, "wall_time_first_start_to_end_s": 115.0,
                                         "wall_time_last_segment_s": 15.0, "segments": 2}   # at 215
    (tmp_path / run_files.SEGMENTS).write_text("{not json")  # timings only: never fails the run
    again = RunFiles(str(tmp_path))
    again.start("config", 8)                     # 300
    assert again.finish_segment(8)["segments"] == 1
    fresh = RunFiles(str(tmp_path))              # a new run (step 0) forgets the old segments
    monkeypatch.setattr(run_files.time, "time", lambda: 400.0)
    fresh.start("config", 0)
    assert fresh.finish_segment(2) == {"wall_time_s": 0.0, "wall_time_first_start_to_end_s": 0.0,
                                       "wall_time_last_segment_s": 0.0, "segments": 1}
