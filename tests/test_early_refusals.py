"""A second trainer or continuous evaluator of a live model_dir is refused before anything
heavy starts (expframe/cli.py `_check_locks`): here TensorFlow cannot even be imported
(a `tensorflow` package that raises is first on the path), so the refusal must come
before its import, as a user sees it: one line naming the holder, exit 2, in about a
second, and nothing written."""

import os
import subprocess
import sys

import pytest

from expframe import dir_lock
from tests import main_runner as mr


@pytest.fixture
def no_tensorflow(tmp_path):
    """An environment whose `import tensorflow` fails."""
    package = tmp_path / "shadow" / "tensorflow"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('TensorFlow was imported before the lock check')\n")
    return dict(mr.env(tmp_path), PYTHONPATH=str(tmp_path / "shadow"))


@pytest.mark.parametrize("mode, lock, message", [
    ("train", dir_lock.WRITER, "is being trained by another process (pid {pid} on host "),
    ("train_and_eval", dir_lock.WRITER, "is being trained by another process (pid {pid} on host "),
    ("continuous_eval", dir_lock.EVALUATOR, "error: another continuous evaluator (pid {pid} on host "),
])
def test_a_second_trainer_or_evaluator_is_refused_before_tensorflow_starts(tmp_path, no_tensorflow, mode, lock,
                                                                          message):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    held = dir_lock.hold(str(model_dir / lock))
    before = sorted(os.listdir(model_dir))
    try:
        done = subprocess.run([sys.executable, mr.MAIN, "--gin_file=experiments/quickstart.gin", f"--mode={mode}",
                               f"--model_dir={model_dir}"], cwd=mr.ROOT, env=no_tensorflow, capture_output=True,
                              text=True, timeout=120)
    finally:
        held.release()
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and message.format(pid=os.getpid()) in errors[0], done.stderr[-3000:]
    assert "TensorFlow was imported" not in done.stderr
    assert sorted(os.listdir(model_dir)) == before


def test_the_shadow_package_does_stop_a_run_that_reaches_tensorflow(tmp_path, no_tensorflow):
    """The negative control: with no lock held, the same command gets as far as the import."""
    done = subprocess.run([sys.executable, mr.MAIN, "--gin_file=experiments/quickstart.gin", "--mode=train",
                           f"--model_dir={tmp_path / 'free'}"], cwd=mr.ROOT, env=no_tensorflow, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "TensorFlow was imported before the lock check" in done.stderr


def test_the_chief_by_the_environment():
    assert dir_lock.is_chief_by_environment({})
    assert not dir_lock.is_chief_by_environment({"SLURM_PROCID": "1"})
    config = '{"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": %d}}'
    assert dir_lock.is_chief_by_environment({"TF_CONFIG": config % 0})
    assert not dir_lock.is_chief_by_environment({"TF_CONFIG": config % 1})
    assert not dir_lock.is_chief_by_environment(
        {"TF_CONFIG": '{"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "worker", "index": 0}}'})
    assert dir_lock.is_chief_by_environment({"TF_CONFIG": '{"cluster": {}, "task": {"type": "chief", "index": 0}}'})
    assert not dir_lock.is_chief_by_environment({"TF_CONFIG": "not json"})
