"""The Slurm array job script: one run per array index, each the local runner's command."""

import os
import re
import shlex
import subprocess

from expframe.run_files import atomic_write
from expframe.sweep import runner, slurm, spec
from tests import main_runner as mr


def _study():
    return spec.build_study(gin_files=["experiments/quickstart.gin"], gin_params=["Trainer.train_steps = 2"],
                            sweeps=["run_experiment.seed=[0, 1]"],
                            zips=["Trainer.global_batch_size=[16, 32]",
                                  "keras.optimizers.Adam.learning_rate=[1e-3, 2e-3]"])


def _texts(study):
    """Stand-ins for the runs' expected parsed configs (spec.validate gives the real ones)."""
    return {r.name: f"# parsed config of {r.name}\nTrainer.train_steps = 2\n" for r in study.runs()}


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
    path = slurm.write_script(study, root, _texts(study), options=["--partition=cpu", "--time=1:00:00"],
                              max_running=2)
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


def _write_run(root, name, parsed_config, result=True):
    """A run's files as main.py leaves them (parsed_config.gin written as main.py writes it)."""
    os.makedirs(os.path.join(root, name))
    atomic_write(os.path.join(root, name, "parsed_config.gin"), parsed_config)
    if result:
        open(os.path.join(root, name, "result.json"), "w").write("{}")


def test_script_skips_finished_runs_and_refuses_bad_indices(tmp_path):
    study = _study()
    root = str(tmp_path / "study")
    texts = _texts(study)
    path = slurm.write_script(study, root, texts)
    assert "#SBATCH --array=0-3\n" in open(path).read()
    finished = study.runs()[2]
    _write_run(root, finished.name, texts[finished.name])
    done = _run_index(path, 2)
    assert done.returncode == 0 and done.stdout.strip() == f"{finished.name}: finished, skipped"
    bad = _run_index(path, 4)
    assert bad.returncode == 2 and "this study has runs 0-3" in bad.stderr
    missing = _run_index(path, None)
    assert missing.returncode != 0 and "submit this script with sbatch" in missing.stderr


def test_script_compares_the_parsed_config_digest_and_never_runs_a_stale_run(tmp_path):
    study = _study()
    root = str(tmp_path / "study")
    texts = _texts(study)
    runs = study.runs()
    stale_text = texts[runs[0].name].replace("= 2", "= 3")  # e.g. an included gin file was edited
    _write_run(root, runs[0].name, stale_text)                   # finished, under another config
    _write_run(root, runs[1].name, stale_text, result=False)     # resumable, under another config
    _write_run(root, runs[2].name, texts[runs[2].name], result=False)  # resumable, same config
    os.makedirs(os.path.join(root, "logs"))
    open(os.path.join(root, "logs", f"{runs[0].name}.log"), "w").write("old output\n")
    path = slurm.write_script(study, root, texts)
    for run in runs[:2]:  # stale: exit 2 with what to do, nothing run or moved
        done = _run_index(path, run.index)
        assert done.returncode == 2 and done.stdout == "", done.stdout
        assert done.stderr.startswith(f"{run.name}: stale, not started") and "--move_stale" in done.stderr
        assert os.path.isfile(os.path.join(root, run.name, "parsed_config.gin"))
    done = _run_index(path, 2)
    assert done.returncode == 0 and f"--model_dir={root}/{runs[2].name}" in done.stdout.splitlines()[-1]

    path = slurm.write_script(study, root, texts, move_stale=True)
    done = _run_index(path, 0)
    assert done.returncode == 0, done.stderr
    assert f"--model_dir={root}/{runs[0].name}" in done.stdout.splitlines()[-1]  # started afresh
    assert not os.path.exists(os.path.join(root, runs[0].name))
    (moved,) = os.listdir(os.path.join(root, runner.STALE))
    moved = os.path.join(root, runner.STALE, moved)
    assert f"moved to {moved}/{runs[0].name}, starting afresh" in done.stdout
    assert open(os.path.join(moved, runs[0].name, "parsed_config.gin")).read() == stale_text
    assert os.path.isfile(os.path.join(moved, runs[0].name, "result.json"))
    assert open(os.path.join(moved, "logs", f"{runs[0].name}.log")).read() == "old output\n"
    # The digest in the script is the one of the file main.py writes.
    assert runner.config_digest(stale_text) == runner.stored_config_digest(os.path.join(moved, runs[0].name))


def test_script_runs_from_the_directory_it_was_written_in(tmp_path):
    text = slurm.script(_study(), "runs/x", _texts(_study()))
    assert f"cd {shlex.quote(os.getcwd())}" in text
    assert shlex.quote(mr.MAIN) in text or mr.MAIN in text
