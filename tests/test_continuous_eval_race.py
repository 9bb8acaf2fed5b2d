"""A continuous evaluator beside a pruning trainer (expframe/continuous_eval.py): the
race between the trainer's pruning (`Trainer.max_checkpoints`) and the evaluator's read,
forced deterministically in one process, on a tiny classifier whose trainer wrote
checkpoints at steps 2, 4, 6 and 8.

The evaluator used to restore every checkpoint into one `tf.train.Checkpoint` root; a
read that failed part-way (the checkpoint deleted under it) left the root a queued
restoration from the deleted file, which the next read replayed, and the evaluator
exited 1 on a checkpoint that was there (issue 58). `read_checkpoint` now reads through
a new root each time, and the evaluator pins what it reads with hard links.
"""

import glob
import io
import os
import re
from contextlib import redirect_stdout

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import functional_saver

import expframe as xf
from expframe import continuous_eval, pinned_checkpoint
from expframe.checkpointer import read_checkpoint
from expframe.run_files import RunFiles
from expframe.tasks.classification import ClassificationTask
from expframe.trainer import Trainer

FEATURES, CLASSES, FINAL = 5, 3, 8


def _dataset(split, ctx, batch_size, training, seed, deterministic):
    del seed, deterministic
    rng = np.random.default_rng(0 if split == "train" else 1)
    images = rng.standard_normal((32, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, 32).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})
    ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.repeat().batch(batch_size, drop_remainder=True) if training else ds.batch(batch_size)


def _trainer(evaluations=None):
    def model():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])

    task = ClassificationTask(model=model, dataset=_dataset, optimizer=lambda: keras.optimizers.Adam(0.01),
                              evaluations=evaluations)
    trainer = Trainer(train_steps=FINAL, global_batch_size=8, steps_per_loop=2, log_every_steps=2,
                      checkpoint_every_steps=2, max_checkpoints=10)
    trainer.prepare(xf.Replicator("cpu", 1), task, seed=0, deterministic=True)
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model_dir with checkpoints at steps 2, 4, 6, 8, and each step's model weights."""
    model_dir = str(tmp_path_factory.mktemp("race") / "run")
    trainer = _trainer()
    out = RunFiles(model_dir)
    trainer.restore(out.checkpoint_dir)
    out.start("", 0)
    with redirect_stdout(io.StringIO()):
        trainer.train(out, evaluate=False)
    out.close()
    weights = {step: tf.train.load_checkpoint(f"{out.checkpoint_dir}/ckpt-{step}").get_tensor(
        "optimizer/optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE") for step in (2, 4, 6, 8)}
    return model_dir, weights


@pytest.fixture
def model_dir(trained, tmp_path):
    """A fresh copy of the trained run (the tests delete its checkpoints)."""
    copy = str(tmp_path / "run")
    os.makedirs(copy)
    for name in os.listdir(trained[0]):
        source = os.path.join(trained[0], name)
        if os.path.isdir(source):
            tf.io.gfile.makedirs(os.path.join(copy, name))
            for f in os.listdir(source):
                tf.io.gfile.copy(os.path.join(source, f), os.path.join(copy, name, f))
    return copy


def _delete(model_dir, step):
    for path in glob.glob(os.path.join(model_dir, "checkpoints", f"ckpt-{step}.*")):
        os.remove(path)


def _evaluate(model_dir, evaluations=None):
    """Runs a continuous evaluator to the final step; returns (its lines, the eval records)."""
    trainer = _trainer(evaluations)
    out = RunFiles(model_dir)
    evaluator = continuous_eval.ContinuousEvaluator(trainer, out, timeout_s=5, poll_s=0.01)
    printed = io.StringIO()
    with redirect_stdout(printed):
        result = evaluator.run()
    out.close()
    return printed.getvalue().splitlines(), result


def _eval_steps(model_dir, split="eval"):
    from expframe import metrics_file  # pylint: disable=import-outside-toplevel
    return [r["step"] for r in metrics_file.records(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == split]


def _deleting_mid_read(monkeypatch, model_dir, steps):
    """The checkpoints of `steps` are deleted from checkpoints/ while they are read: after
    the object graph was read, before the first variable's value (RestoreV2)."""
    real = functional_saver.io_ops.restore_v2

    def restore_v2(prefix, *args, **kwargs):
        step = int(re.search(r"ckpt-(\d+)$", prefix.numpy().decode()).group(1))
        if step in steps:
            steps.discard(step)
            _delete(model_dir, step)
        return real(prefix, *args, **kwargs)

    monkeypatch.setattr(functional_saver.io_ops, "restore_v2", restore_v2)


def test_a_read_that_failed_part_way_leaves_nothing_for_the_next(trained, model_dir, monkeypatch):
    """The cause itself: the same objects read a checkpoint deleted mid-read, then the next."""
    _deleting_mid_read(monkeypatch, model_dir, {2})
    trainer = _trainer()
    objects = trainer.evaluation_objects()
    cause = read_checkpoint(objects, os.path.join(model_dir, "checkpoints", "ckpt-2"))
    assert cause is not None and "Failed to find any matching files" in cause
    assert read_checkpoint(objects, os.path.join(model_dir, "checkpoints", "ckpt-4")) is None
    assert int(trainer.step.numpy()) == 4
    np.testing.assert_array_equal(trainer.task.model.layers[0].kernel.numpy(), trained[1][4])
    # The old way (one root, restored into again and again) fails on the deleted file: a
    # negative control that this test forces the race that broke the evaluator.
    root = tf.train.Checkpoint(**objects)
    _deleting_mid_read(monkeypatch, model_dir, {6})
    with pytest.raises(tf.errors.NotFoundError):
        root.restore(os.path.join(model_dir, "checkpoints", "ckpt-6"))
    with pytest.raises(tf.errors.NotFoundError, match="ckpt-6"):
        root.restore(os.path.join(model_dir, "checkpoints", "ckpt-8"))


def test_deleted_mid_read_without_hard_links_is_skipped_and_the_evaluator_ends_at_the_final_step(
        trained, model_dir, monkeypatch):
    def unpinnable(prefix, folder):
        raise pinned_checkpoint.Unpinnable("no hard links here")

    monkeypatch.setattr(pinned_checkpoint, "pin", unpinnable)
    _deleting_mid_read(monkeypatch, model_dir, {2})
    lines, result = _evaluate(model_dir)
    skips = [line for line in lines if "skipped" in line]
    assert skips == ["continuous evaluation: skipped step 2: its checkpoint was deleted by the trainer's pruning "
                     "(Trainer.max_checkpoints) while it was read",
                     "continuous evaluation: skipped step(s) 4, 6: it fell behind the trainer (their checkpoints "
                     "were pruned by Trainer.max_checkpoints, or newer ones waited); evaluating step 8, the newest"]
    assert _eval_steps(model_dir) == [8] and result["step"] == FINAL and not result.get("preempted")


def test_a_pinned_checkpoint_deleted_mid_read_is_evaluated_all_the_same(trained, model_dir, monkeypatch):
    _deleting_mid_read(monkeypatch, model_dir, {2, 4})
    lines, _ = _evaluate(model_dir)
    assert not [line for line in lines if "skipped" in line], lines
    assert _eval_steps(model_dir) == [2, 4, 6, 8]
    assert not glob.glob(os.path.join(model_dir, "checkpoints", "ckpt-2.*"))  # deleted, yet read from its pin
    assert not os.path.exists(os.path.join(model_dir, pinned_checkpoint.FOLDER))  # the pins are gone


def test_deleted_between_listing_and_reading_is_skipped_in_one_line(trained, model_dir, monkeypatch):
    real = continuous_eval.listed_checkpoints
    pending = {2}

    def listed(checkpoint_dir):
        found = real(checkpoint_dir)
        for step in list(pending):
            pending.discard(step)
            _delete(model_dir, step)  # pruned right after the listing
        return found

    monkeypatch.setattr(continuous_eval, "listed_checkpoints", listed)
    lines, _ = _evaluate(model_dir)
    skips = [line for line in lines if "skipped" in line]
    assert skips[0] == ("continuous evaluation: skipped step 2: its checkpoint was deleted by the trainer's pruning "
                        "(Trainer.max_checkpoints) before it was read")
    assert len(skips) == 2 and "skipped step(s) 4, 6" in skips[1]
    assert _eval_steps(model_dir) == [8]


def test_named_evaluations_are_recorded_apart_in_one_append_per_step(trained, model_dir):
    lines, _ = _evaluate(model_dir, evaluations={"eval_train": "train"})
    assert _eval_steps(model_dir) == [2, 4, 6, 8]
    assert _eval_steps(model_dir, "eval_train") == [2, 4, 6, 8]
    assert any(line.startswith("eval_train at step 8: ") for line in lines)
    assert sorted(os.listdir(model_dir)).count("eval_train") == 1  # its own TensorBoard folder
