"""docs/extending.md runs as written (issue 19, item 3): its shell blocks, executed one by
one with bash from the clone's root, copy examples/regression into a folder outside the
clone (a temporary HOME) and run it there on 1 and 2 replicas and on two worker
processes under the launcher. The numbers the page states are checked here."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests import main_runner as mr

DOC = os.path.join(mr.ROOT, "docs", "extending.md")
BLOCK = re.compile(r"```sh\n(.*?)```", re.S)


def _blocks():
    with open(DOC, encoding="utf-8") as f:
        return BLOCK.findall(f.read())


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory):
    """Runs every sh block of the page; returns (home, outputs)."""
    home = tmp_path_factory.mktemp("home")
    env = dict(os.environ, HOME=str(home), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([mr.ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p]))
    env.pop("TF_CONFIG", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the quiet start is expframe's own
    if shutil.which("expframe") is None:  # not installed (`pip install -e .` adds it): the same program
        shim = home / "bin"
        shim.mkdir()
        (shim / "expframe").write_text(f"#!/bin/sh\nexec {sys.executable} -m expframe \"$@\"\n")
        (shim / "expframe").chmod(0o755)
        env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    outputs = []
    for block in _blocks():
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=mr.ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"block failed:\n{block}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
    return home / "my_regression", outputs


def _losses(run):
    with open(run / "metrics.jsonl", encoding="utf-8") as f:
        return [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]


def test_the_page_has_the_runs_it_describes():
    text = "\n".join(_blocks())
    assert "cp -r examples/regression ~/my_regression" in text and "--dry_run" in text
    assert "Replicator.num_replicas = 2" in text and "python -m expframe.launch --workers=2" in text


def test_example_runs_outside_the_clone_and_learns(doc_run):
    folder, outputs = doc_run
    first = outputs[0]
    assert ("dry run: the configuration is valid: target 'cpu', 1 replica(s), global batch 64, 1200 steps; "
            "runs/one would start at step 0. Nothing was trained") in first
    result = json.loads((folder / "runs" / "one" / "result.json").read_text())
    assert result["step"] == 1200 and result["eval"]["mse"] < 0.05  # the test data's variance is 2.17
    with open(DOC, encoding="utf-8") as f:
        assert f"eval at step 1200: mse {result['eval']['mse']:.4f}  mae {result['eval']['mae']:.4f}" in f.read()
    for output in outputs:  # a quiet start: none of TensorFlow's start-up notices
        assert "cuInit" not in output and "absl::InitializeLog" not in output and "Traceback" not in output


def test_one_and_two_replicas_and_two_workers_give_the_same_losses(doc_run):
    folder, _ = doc_run
    one = _losses(folder / "runs" / "one_200")
    assert len(one) == 2
    for other in ("two_200", "workers_200"):
        np.testing.assert_allclose(_losses(folder / "runs" / other), one, rtol=1e-5, err_msg=other)
    assert json.loads((folder / "runs" / "workers_200" / "result.json").read_text())["num_replicas"] == 2
    assert (folder / "curves.png").stat().st_size > 1000


def test_line_counts_in_the_page_are_the_files(doc_run):
    del doc_run
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    for name in ("mlp_model.py", "sine_data.py", "regression_task.py", "regression.gin"):
        with open(os.path.join(mr.ROOT, "examples", "regression", name), encoding="utf-8") as f:
            count = len(f.read().splitlines())
        assert f"(../examples/regression/{name}) | {count} |" in text, (name, count)
