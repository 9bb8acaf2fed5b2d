"""`python -m expframe.sweep` end to end: the shipped quickstart study at a tiny size
through the real main.py, resumed, with a failing run; config errors; --emit."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from expframe import tf_noise
from expframe.sweep import __main__ as cli
from expframe.sweep import plots, runner, summary
from tests import main_runner as mr

STUDY = "experiments/studies/quickstart_batch.gin"
# The shipped study with its sweeps shrunk on the command line: 2 runs of 2 steps on
# the small shapes build and one replica (half the tracing), the second with a
# learning rate that makes the loss NaN.
TINY = ["--gin_param=shapes_input.num_train = 512", "--gin_param=shapes_input.num_test = 64",
        "--gin_param=Replicator.num_replicas = 1",
        "--gin_param=Trainer.steps_per_loop = 1", "--gin_param=Trainer.log_every_steps = 1",
        "--gin_param=Trainer.eval_every_steps = None", "--gin_param=Trainer.eval_steps = 1",
        "--gin_param=Trainer.checkpoint_every_steps = 1",
        "--zip=Trainer.global_batch_size=[16, 32]", "--zip=keras.optimizers.Adam.learning_rate=[1e-3, 1e30]",
        "--zip=Trainer.train_steps=[2, 2]", "--sweep=run_experiment.seed=[0]"]
OK_RUN = "global_batch_size=16,learning_rate=0.001,train_steps=2,seed=0"
FAILING_RUN = "global_batch_size=32,learning_rate=1e+30,train_steps=2,seed=0"


@pytest.fixture(autouse=True)
def in_repo(monkeypatch, data_dir):
    monkeypatch.chdir(mr.ROOT)
    monkeypatch.setenv("TFDS_DATA_DIR", str(data_dir))


def _table(root):
    with open(os.path.join(root, summary.CSV), newline="") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def _assert_png(path):
    with Image.open(path) as image:
        image.verify()


def test_quickstart_study_runs_resumes_and_records_a_failure(tmp_path, capsys):
    root = str(tmp_path / "study")
    argv = [f"--study={STUDY}", f"--study_dir={root}", "--parallel=2"] + TINY
    env = mr.env(os.environ["TFDS_DATA_DIR"])
    env.pop("TF_CPP_MIN_LOG_LEVEL")  # as a user's shell
    first = subprocess.run([sys.executable, "-m", "expframe.sweep"] + argv, cwd=mr.ROOT,
                           env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stdout + first.stderr  # one run failed; the other finished
    # As quiet as main.py: none of TensorFlow's start-up lines (the old command printed
    # the absl banner, cuda and CPU-instruction notices from its own import of TensorFlow).
    noise = [line for line in (first.stdout + first.stderr).splitlines()
             if tf_noise.is_noise(line) or re.match(r"^(\[\d+/\d+\] )?[IWEF]\d{4} ", line)]
    assert noise == [], noise
    assert first.stderr.splitlines() == [f"error: 1 of 2 run(s) not ok: 1 failed ({FAILING_RUN}): see their logs in "
                                         f"{os.path.join(root, 'logs')}."], first.stderr
    processes, threads = runner.worker_count(2, runner.available_cores())
    assert f"2 of 2 run(s) to do, {processes} at a time, {threads} intra-op thread(s) each" in first.stdout

    table = _table(root)
    assert list(table) == [OK_RUN, FAILING_RUN]
    ok, failed = table[OK_RUN], table[FAILING_RUN]
    assert (ok["status"], ok["exit_code"], ok["step"]) == ("ok", "0", "2")
    assert (ok["global_batch_size"], ok["learning_rate"], ok["seed"]) == ("16", "0.001", "0")
    assert 0.0 <= float(ok["eval_top1"]) <= float(ok["eval_top5"]) <= 1.0
    assert float(ok["examples_per_sec"]) > 0 and float(ok["wall_time_s"]) > 0
    assert (failed["status"], failed["exit_code"]) == ("failed", "1")
    assert "loss is nan at step 2" in failed["error"].lower() or "loss is inf at step 2" in failed["error"].lower()
    # Each run is an ordinary main.py run in its own model_dir.
    result = json.loads(open(os.path.join(root, OK_RUN, "result.json")).read())
    assert (result["step"], result["global_batch_size"], result["num_replicas"]) == (2, 16, 1)
    given = open(os.path.join(root, OK_RUN, "config.gin")).read()
    assert "keras.optimizers.Adam.learning_rate = 0.001" in given and "Trainer.global_batch_size = 16" in given
    assert [r["step"] for r in mr.metrics(os.path.join(root, OK_RUN), "train")] == [1, 2]
    md = open(os.path.join(root, summary.MARKDOWN)).read()
    assert "1 ok, 1 failed of 2 run(s)." in md and f"| {OK_RUN} | 16 | 0.001 | 2 | 0 | ok |" in md
    for name in (plots.FINAL, plots.CURVES):
        _assert_png(os.path.join(root, name))
    study_json = json.loads(open(os.path.join(root, "study.json")).read())
    assert [r["name"] for r in study_json["runs"]] == [OK_RUN, FAILING_RUN]

    # The same command again: the finished run is skipped, the failed one resumes from
    # its checkpoint (step 1) and fails again; the table keeps both.
    finished_at = os.path.getmtime(os.path.join(root, OK_RUN, "result.json"))
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert f"[1/2] {OK_RUN}: finished, skipped" in out and "1 of 2 run(s) to do" in out
    assert os.path.getmtime(os.path.join(root, OK_RUN, "result.json")) == finished_at
    assert len(runner.read_record(root, OK_RUN)["attempts"]) == 1
    attempts = runner.read_record(root, FAILING_RUN)["attempts"]
    assert [a["exit_code"] for a in attempts] == [1, 1]
    assert "resuming from step 1" in open(os.path.join(root, "logs", f"{FAILING_RUN}.log")).read()
    again = _table(root)
    assert again[OK_RUN]["eval_top1"] == ok["eval_top1"] and again[FAILING_RUN]["status"] == "failed"

    # --emit=summary rebuilds the table and plots from disk, running nothing; a run is
    # not ok, so it exits 1 too, naming it.
    os.remove(os.path.join(root, summary.CSV))
    os.remove(os.path.join(root, plots.FINAL))
    capsys.readouterr()
    assert cli.main(argv + ["--emit=summary"]) == 1
    assert f"1 of 2 run(s) not ok: 1 failed ({FAILING_RUN}): see their logs in" in capsys.readouterr().err
    assert _table(root) == again and os.path.isfile(os.path.join(root, plots.FINAL))
    assert len(runner.read_record(root, FAILING_RUN)["attempts"]) == 2


@pytest.mark.parametrize("flag,names", [
    ("--sweep=Trainer.train_step=[1, 2]", ["Trainer.train_step", "did you mean 'train_steps'"]),
    ("--sweep=Trainr.seed=[0, 1]", ["Trainr.seed", "did you mean 'Trainer'"]),
    ("--sweep=run_experiment.sed=[0, 1]", ["run_experiment.sed", "did you mean 'seed'"]),
    ("--sweep=Trainer.global_batch_size=[16, 16]", ["Trainer.global_batch_size = 16 comes twice"]),
    ("--gin_param=Trainer.train_steps = 3", ["binds Trainer.train_steps, which the study sweeps"]),
])
def test_config_error_exits_2_before_anything_runs(tmp_path, capsys, flag, names):
    root = tmp_path / "study"
    argv = [f"--study={STUDY}", f"--study_dir={root}", flag]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for name in names:
        assert name in err, err
    assert not root.exists()  # nothing written


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--parallel=two"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    assert cli.main([f"--study={STUDY}", "--parallel=0"]) == 2
    assert "--parallel=0 must be at least 1" in capsys.readouterr().err


def test_emit_slurm_writes_the_script_and_runs_nothing(tmp_path, capsys):
    root = tmp_path / "study"
    assert cli.main([f"--study={STUDY}", f"--study_dir={root}", "--emit=slurm", "--parallel=3",
                     "--slurm_option=--cpus-per-task=2"]) == 0
    text = (root / "study.sbatch").read_text()
    assert "#SBATCH --array=0-7%3" in text and "#SBATCH --cpus-per-task=2" in text
    assert text.count("NAME=") == 8 and "global_batch_size=512,learning_rate=0.008,train_steps=160,seed=1" in text
    assert sorted(os.listdir(root)) == ["logs", "study.sbatch"]  # no run started
    assert "sbatch" in capsys.readouterr().out


@pytest.mark.slow
def test_resnet50_scaling_study_on_mock_data(tmp_path):
    """The shipped ResNet-50 study, 2 of its points at 64x64: minutes on 2 cores."""
    root = str(tmp_path / "study")
    argv = ["--study=experiments/studies/resnet50_scaling.gin", f"--study_dir={root}",
            "--gin_param=imagenet_input.image_size = 64", "--gin_param=resnet.input_shape = (64, 64, 3)",
            "--gin_param=imagenet_input.mock_num_examples = 16",
            "--zip=Replicator.num_replicas=[1, 2]", "--zip=Trainer.global_batch_size=[2, 4]"]
    assert cli.main(argv) == 0
    table = _table(root)
    assert [(r["num_replicas"], r["global_batch_size"], r["status"], r["step"]) for r in table.values()] == [
        ("1", "2", "ok", "6"), ("2", "4", "ok", "6")]
    assert all(float(r["examples_per_sec"]) > 0 for r in table.values())
    _assert_png(os.path.join(root, plots.FINAL))


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_study_is_validated_is_one_line_and_exit_130(tmp_path):
    # SIGINT once TensorFlow's library is loaded: the study process is validating the study.
    env = mr.env(os.environ["TFDS_DATA_DIR"])
    proc = subprocess.Popen([sys.executable, "-m", "expframe.sweep", f"--study={STUDY}",
                             f"--study_dir={tmp_path / 'study'}"], cwd=mr.ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/maps", encoding="utf-8", errors="replace") as f:
            if "libtensorflow" in f.read():
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 130, out + err
    assert err.splitlines() == ["python -m expframe.sweep: stopped by SIGINT; no run is running. Rerun the same "
                                "command to continue."], err
    assert not (tmp_path / "study").exists()
