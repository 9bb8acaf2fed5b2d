"""A model_dir that cannot be written, and a disk that fills during a run
(docs/stopping.md): one line each; a full disk exits 1 with the last good checkpoint
intact and no temporary folder left, and the resume after space is freed is exact."""

import glob
import os
import subprocess

import numpy as np
import pytest

from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
# A checkpoint of this run is 0.92 MB: 1,500 KB hold the first, not a second beside it.
PARAMS = mr.SMALL + mr.ONE_REPLICA + ("run_experiment.deterministic = True", "Trainer.checkpoint_every_steps = 2",
                                      "Trainer.max_checkpoints = 1")


def _mount_tmpfs(path, size):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def _errors(done):
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def _weights(model_dir):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if n.startswith("model/")}


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_resume_is_exact(data_dir, tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1500k"):
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk case runs where it can")
    try:
        model_dir = disk / "run"
        full = mr.run([QUICKSTART], model_dir, data_dir, PARAMS, extra=["--mode=train"])
        assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-2000:]
        assert len(_errors(full)) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        line = _errors(full)[0]
        assert line.startswith("error: no space left on the device: writing the checkpoint of step 4 into "), line
        assert f"the last good checkpoint is {model_dir}/checkpoints/ckpt-2;" in line, line
        assert sorted(os.listdir(model_dir / "checkpoints")) == [
            "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]  # no ckpt-4_temp left
        assert not glob.glob(str(model_dir / "**" / ".tmp_*"), recursive=True)
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)  # space is freed
        resumed = mr.run([QUICKSTART], model_dir, data_dir, PARAMS, extra=["--mode=train"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resuming from step 2 " in resumed.stdout
        straight = tmp_path / "straight"
        done = mr.run([QUICKSTART], straight, data_dir, PARAMS, extra=["--mode=train"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in mr.metrics(model_dir, "train")] == [2, 4, 6]
        assert ([r["loss"] for r in mr.metrics(model_dir, "train")]
                == [r["loss"] for r in mr.metrics(straight, "train")])
        a, b = _weights(straight), _weights(model_dir)
        assert a.keys() == b.keys() and a
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("extra", [["--dry_run"], ["--mode=train"]])
def test_an_unwritable_model_dir_is_one_line_and_exit_2(data_dir, tmp_path, extra):
    parent = tmp_path / "locked"
    parent.mkdir()
    if subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root on a filesystem that has it)")
    try:
        done = mr.run([QUICKSTART], parent / "run", data_dir, PARAMS, extra=extra)
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert _errors(done) == [f"error: --model_dir={parent / 'run'} cannot be written (Operation not permitted in "
                             f"{parent}); fix its permissions or mount, or choose another --model_dir."]
    assert os.listdir(parent) == []


def test_a_full_disk_at_start_up_is_one_line_and_leaves_nothing(data_dir, tmp_path):
    """At 0, 4 and 16 KB free the start fails at the run's files (at 0 KB the writer lock
    holds without its owner line) and the first metrics record: each one line, exit 1, no
    traceback, and the new model_dir is gone; once space is freed the same command trains."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk case runs where it can")
    model_dir = disk / "run"
    params = PARAMS + ("Trainer.checkpoint_every_steps = 4", "Trainer.eval_every_steps = None")
    try:
        failed_at = []
        for free_kb in (0, 4, 16):
            (disk / "filler").write_bytes(b"")
            used = sum(os.path.getsize(disk / f) for f in os.listdir(disk))
            (disk / "filler").write_bytes(b"\0" * (256 * 1024 - free_kb * 1024 - used))
            done = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
            assert done.returncode == 1, (free_kb, done.stdout[-2000:] + done.stderr[-2000:])
            assert len(_errors(done)) == 1 and "Traceback" not in done.stderr, (free_kb, done.stderr[-3000:])
            assert _errors(done)[0].startswith("error: no space left on the device: writing "), _errors(done)
            failed_at.append(_errors(done)[0].split("writing ")[1].split(" of step")[0])
            assert sorted(os.listdir(disk)) == ["filler"], (free_kb, os.listdir(disk))
        assert failed_at == ["the run's files", "the run's files", "the provenance record"]
        (disk / "filler").unlink()
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        done = mr.run([QUICKSTART], model_dir, data_dir, params, extra=["--mode=train"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in mr.metrics(model_dir, "train")] == [2, 4, 6]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
