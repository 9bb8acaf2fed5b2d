"""The restore policy (issue 9, item 2): an unreadable newest checkpoint falls back to an
older one with a line saying so; checkpoints that exist but cannot be read are a
RunError that names them, never a fresh start, and nothing is deleted; workers
restore the same step or fail."""

import os

import numpy as np
import pytest
import tensorflow as tf

from expframe.checkpointer import Checkpointer, checkpoints_in
from expframe.data_position import DataPosition
from expframe.errors import RunError


class Workers:
    """The replicator of worker 1 of 2: `agree` combines this worker's value with the
    other worker's, in the order the Checkpointer asks (its step for min and max, then
    whether it failed to restore the agreed step)."""

    num_workers, worker_index = 2, 1

    def __init__(self, other_step, other_fails=False):
        self._other = [other_step, other_step, float(other_fails)]
        self._calls = 0

    def agree(self, value, op):
        other = self._other[self._calls]
        self._calls += 1
        return float(max(value, other) if op == "max" else min(value, other))


class OneWorker:
    num_workers, worker_index = 1, 0

    def agree(self, value, op):
        del op
        return value


def _checkpointer(replicator=None):
    step = tf.Variable(0, dtype=tf.int64)
    weights = tf.Variable(tf.zeros([64]))
    replicator = replicator or OneWorker()
    return Checkpointer(replicator, step, {"weights": weights}, DataPosition(replicator, None, 3), 3), weights


@pytest.fixture
def saved(tmp_path):
    """A checkpoint dir holding steps 2 and 4 (weights = step)."""
    ckpt, weights = _checkpointer()
    assert ckpt.restore(str(tmp_path)) == 0
    for step in (2, 4):
        ckpt.step.assign(step)
        weights.assign(tf.fill([64], float(step)))
        ckpt.save()
    return str(tmp_path)


def _damage(directory, step, how):
    data = os.path.join(directory, f"ckpt-{step}.data-00000-of-00001")
    if how == "truncate":
        with open(data, "r+b") as f:
            f.truncate(10)
    else:  # flip bytes: the tensor checksum no longer matches
        raw = bytearray(open(data, "rb").read())
        raw[-20] ^= 0xFF
        open(data, "wb").write(bytes(raw))


def _snapshot(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_an_unreadable_newest_checkpoint_falls_back_to_the_older_one_and_says_so(saved, capsys):
    _damage(saved, 4, "truncate")
    ckpt, weights = _checkpointer()
    assert ckpt.restore(saved) == 2
    np.testing.assert_array_equal(weights.numpy(), np.full([64], 2.0))
    out = capsys.readouterr().out
    assert "could not read the newer checkpoint(s) ckpt-4 (" in out and "restored the older ckpt-2 (step 2)" in out


def test_checkpoints_that_cannot_be_read_are_an_error_and_nothing_changes(saved):
    _damage(saved, 4, "truncate")
    _damage(saved, 2, "flip")
    before = _snapshot(saved)
    ckpt, _ = _checkpointer()
    with pytest.raises(RunError) as error:
        ckpt.restore(saved)
    message = str(error.value)
    assert "\n" not in message
    assert f"cannot read any checkpoint in {saved}: ckpt-4 (" in message and "; ckpt-2 (" in message
    assert "Read less bytes than requested" in message and "Checksum does not match" in message
    assert "Nothing was deleted" in message
    assert _snapshot(saved) == before


@pytest.mark.parametrize("index", ["missing", "garbled"])
def test_a_lost_index_file_does_not_hide_the_checkpoints(saved, index):
    path = os.path.join(saved, "checkpoint")
    if index == "missing":
        os.remove(path)
    else:
        open(path, "w", encoding="utf-8").write("not a checkpoint state {")
    assert tf.train.CheckpointManager(tf.train.Checkpoint(), saved, 3).checkpoints == []  # TensorFlow's view
    assert [s for s, _ in checkpoints_in(saved)] == [4, 2]
    ckpt, weights = _checkpointer()
    assert ckpt.restore(saved) == 4
    np.testing.assert_array_equal(weights.numpy(), np.full([64], 4.0))


def test_workers_that_read_different_steps_all_restore_the_older(saved, capsys):
    ckpt, weights = _checkpointer(Workers(2))  # the other worker read step 2
    assert ckpt.restore(saved) == 2
    np.testing.assert_array_equal(weights.numpy(), np.full([64], 2.0))
    out = capsys.readouterr().out
    assert "worker 1 restored step 2, the newest that every worker reads (it had read step 4)" in out


def test_a_worker_that_finds_no_checkpoint_fails_the_run(saved, tmp_path):
    ckpt, _ = _checkpointer(Workers(4))
    with pytest.raises(RunError, match="worker 1 finds no checkpoint in .* another worker restored step 4: "
                                       "put the checkpoints on a filesystem every worker sees"):
        ckpt.restore(str(tmp_path / "elsewhere"))
    ckpt, _ = _checkpointer(Workers(0))  # and the worker that found some fails too
    with pytest.raises(RunError, match="worker 1 restored step 4 .* another worker found no readable checkpoint"):
        ckpt.restore(saved)


def test_workers_fail_when_one_cannot_follow_the_agreed_step(saved):
    _damage(saved, 2, "flip")
    ckpt, _ = _checkpointer(Workers(2))  # the other has only step 2; this one cannot read it
    with pytest.raises(RunError, match=r"different checkpoints \(steps 2 to 4\).* worker 1 cannot read step 2"):
        ckpt.restore(saved)
