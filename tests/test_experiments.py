"""Every shipped gin file parses, and the target files switch exactly Replicator.target."""

import glob
import os

import gin
import pytest

from expframe import config
from tests import main_runner as mr

TARGET_FILES = {
    "experiments/targets/cpu.gin": "cpu",
    "experiments/targets/gpu.gin": "gpu",
    "experiments/targets/tpu.gin": "tpu",
    "experiments/targets/multi_worker.gin": "multi_worker",
    "experiments/targets/parameter_server.gin": "parameter_server",
}


def test_every_target_file_is_listed():
    shipped = {os.path.relpath(p, mr.ROOT) for p in glob.glob(os.path.join(mr.ROOT, "experiments/targets/*.gin"))}
    assert shipped == set(TARGET_FILES)


@pytest.mark.parametrize("path,target", sorted(TARGET_FILES.items()))
def test_target_file_switches_the_quickstart(path, target, monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    text = config.parse(["experiments/quickstart.gin", path], [])
    assert gin.query_parameter("Replicator.target") == target
    assert gin.query_parameter("resnet.depth") == 8  # the experiment itself is unchanged
    assert path in text
    gin.clear_config()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(mr.ROOT, "experiments", "*.gin"))))
def test_every_experiment_parses(path, monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    config.parse([os.path.relpath(path, mr.ROOT)], [])
    assert gin.query_parameter("run_experiment.task") is not None
    gin.clear_config()
