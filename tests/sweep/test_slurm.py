"""The Slurm array job script: one run per array index, each the local runner's command."""

import os
import re
import shlex
import subprocess

from expframe.sweep import runner, slurm, spec
from tests import main_runner as mr


def _study():
    return spec.build_study(gin_files=["experiments/quickstart.gin"], gin_params=["Trainer.train_steps = 2"],
                            sweeps=["run_experiment.seed=[0, 1]"],
                            zips=["Trainer.global_batch_size=[16, 32]",
                                  "keras.optimizers.Adam.learning_rate=[1e-3, 2e-3]"])


def _run_index(path, index, env=None):
    env = dict(os.environ, PYTHON="echo", **(env or {}))
    if index is not None:
        env["SLURM_ARRAY_TASK_ID"] = str(index)
    else:
        env.pop("SLURM_ARRAY_TASK_ID", None)
    return subprocess.run(["bash", path], env=env, capture_output=True, text=True, timeout=60)


def test_script_names_one_run_per_array_index(tmp_path):
    study = _study()
    root = str(tmp_path / "study")
    path = slurm.write_script(study, root, options=["--partition=cpu", "--time=1:00:00"], max_running=2)
    text = open(path).read()
    runs = study.runs()
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --partition=cpu" in text and "#SBATCH --time=1:00:00" in text
    assert "#SBATCH --job-name=quickstart_study" in text
    assert f"#SBATCH --output={root}/logs/slurm-%A_%a.out" in text and os.path.isdir(os.path.join(root, "logs"))
    indexed = dict(re.findall(r"^  (\d+)\) NAME=(\S+);", text, flags=re.M))
    assert indexed == {str(r.index): shlex.quote(r.name) for r in runs}
    for run in runs:  # each index runs exactly the runner's main.py command
        done = _run_index(path, run.index)
        assert done.returncode == 0, done.stderr
        argv = runner.command(study, run, root)[1:]
        assert done.stdout.splitlines()[-1] == " ".join(argv)
        assert f"--model_dir={root}/{run.name}" in done.stdout
    assert os.access(path, os.X_OK)


def test_script_skips_finished_runs_and_refuses_bad_indices(tmp_path):
    study = _study()
    root = str(tmp_path / "study")
    path = slurm.write_script(study, root)
    assert "#SBATCH --array=0-3\n" in open(path).read()
    finished = study.runs()[2]
    os.makedirs(os.path.join(root, finished.name))
    open(os.path.join(root, finished.name, "result.json"), "w").write("{}")
    done = _run_index(path, 2)
    assert done.returncode == 0 and done.stdout.strip() == f"{finished.name}: finished, skipped"
    bad = _run_index(path, 4)
    assert bad.returncode == 2 and "this study has runs 0-3" in bad.stderr
    missing = _run_index(path, None)
    assert missing.returncode != 0 and "submit this script with sbatch" in missing.stderr


def test_script_runs_from_the_directory_it_was_written_in(tmp_path):
    text = slurm.script(_study(), "runs/x")
    assert f"cd {shlex.quote(os.getcwd())}" in text
    assert shlex.quote(mr.MAIN) in text or mr.MAIN in text
