"""Slurm's warning before a time limit: the run checkpoints and exits, the job is requeued and resumes.

No Slurm here: the scripts run with bash, with the SLURM_* variables a job has, and
tests/fake_slurm/ first on PATH (`srun` runs the tasks locally and forwards signals as
srun does; `scontrol` records its arguments). The test sends SIGTERM to the script's
shell alone, as `#SBATCH --signal=B:TERM@<grace>` does.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from expframe import slurm_requeue
from expframe.sweep import slurm, spec
from tests import main_runner as mr

FAKE_SLURM = os.path.join(mr.ROOT, "tests", "fake_slurm")

# Stands in for main.py under the array script: waits, checkpoints on SIGTERM.
_FAKE_RUN = textwrap.dedent("""\
    #!/bin/bash
    sleep 60 > /dev/null 2>&1 &
    sleeper=$!
    trap 'echo "got SIGTERM: checkpoint saved"; kill $sleeper; exit 0' TERM
    echo "ready"
    wait $sleeper
    echo "finished"
""")


def _slurm_env(tmp_path, **extra):
    env = dict(mr.env(tmp_path), PATH=FAKE_SLURM + os.pathsep + os.environ["PATH"],
               FAKE_SLURM_LOG=str(tmp_path / "scontrol.log"), SLURM_JOB_ID="1001", SLURM_NTASKS="1")
    env.update(extra)
    return env


def _start(script, env):
    return subprocess.Popen(["bash", script], env=env, cwd=mr.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _scontrol(tmp_path):
    path = tmp_path / "scontrol.log"
    return path.read_text().splitlines() if path.exists() else []


def _config_texts(study):
    """Stand-ins for the runs' expected parsed configs (spec.validate gives the real ones)."""
    return {r.name: f"# parsed config of {r.name}\n" for r in study.runs()}


def test_both_scripts_ask_for_requeue_and_the_warning_signal(tmp_path):
    study = spec.build_study(gin_files=["experiments/quickstart.gin"], sweeps=["run_experiment.seed=[0, 1]"])
    texts = [slurm.script(study, str(tmp_path / "study"), _config_texts(study)),
             slurm.script(study, str(tmp_path / "study"), _config_texts(study), grace_s=300),
             slurm_requeue.single_run_script(["main.py", "--gin_file=experiments/quickstart.gin"], 4,
                                             ["--nodes=4"], grace_s=90)]
    for text, grace in zip(texts, (120, 300, 90), strict=True):
        lines = text.splitlines()
        sbatch = [line for line in lines if line.startswith("#SBATCH")]
        assert {"#SBATCH --requeue", f"#SBATCH --signal=B:TERM@{grace}", "#SBATCH --open-mode=append"} <= set(sbatch)
        # sbatch reads options only before the first command.
        first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
        assert max(lines.index(line) for line in sbatch) < first_command
        assert 'scontrol requeue "$job"' in text and "trap '" in text
    assert "#SBATCH --ntasks=4" in texts[2] and "#SBATCH --nodes=4" in texts[2]
    assert 'srun --kill-on-bad-exit=1 "$PYTHON" "${ARGS[@]}" &' in texts[2]
    with pytest.raises(ValueError, match="positive number of seconds"):
        slurm_requeue.sbatch_lines(0)


@pytest.mark.timeout(120)
def test_sweep_array_task_forwards_the_warning_waits_and_requeues_itself(tmp_path):
    study = spec.build_study(gin_files=["experiments/quickstart.gin"], sweeps=["run_experiment.seed=[0, 1]"])
    script = slurm.write_script(study, str(tmp_path / "study"), _config_texts(study))
    fake = tmp_path / "fake_python"
    fake.write_text(_FAKE_RUN)
    fake.chmod(0o755)
    env = _slurm_env(tmp_path, PYTHON=str(fake), SLURM_ARRAY_JOB_ID="1000", SLURM_ARRAY_TASK_ID="1")
    proc = _start(script, env)
    lines = []
    for line in proc.stdout:  # the run started: now the warning, to the batch shell only
        lines.append(line)
        if line.strip() == "ready":
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "got SIGTERM: checkpoint saved" in out and "finished" not in out, out
    assert "expframe: the run exited with status 0; requeueing job 1000_1" in out, out
    assert _scontrol(tmp_path) == ["requeue 1000_1"]
    # A task that is not warned runs to its end and is not requeued.
    quick = tmp_path / "quick_python"
    quick.write_text("#!/bin/bash\necho finished\n")
    quick.chmod(0o755)
    done = subprocess.run(["bash", script], env=dict(env, PYTHON=str(quick)), cwd=mr.ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("finished"), done.stdout + done.stderr
    assert _scontrol(tmp_path) == ["requeue 1000_1"]


@pytest.mark.timeout(900)
def test_single_run_script_checkpoints_on_the_warning_and_the_requeued_job_resumes(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    params = mr.SMALL + ("Replicator.num_replicas = 1", "Trainer.train_steps = 30", "Trainer.steps_per_loop = 1",
                         "Trainer.log_every_steps = 1", "Trainer.checkpoint_every_steps = 1000")
    emitted = subprocess.run(
        [sys.executable, "-m", "expframe.launch", "--emit=slurm", "--workers=1", "--signal_grace_s=60", "--",
         "main.py", "--gin_file=experiments/quickstart.gin"] + [f"--gin_param={p}" for p in params]
        + [f"--model_dir={model_dir}", "--mode=train"], cwd=mr.ROOT, capture_output=True, text=True, timeout=60)
    assert emitted.returncode == 0, emitted.stderr
    script = tmp_path / "run.sbatch"
    script.write_text(emitted.stdout)
    env = _slurm_env(tmp_path, TFDS_DATA_DIR=str(data_dir))
    first = _start(str(script), env)
    lines = mr.wait_for_line(first, "step 3/30", timeout=600)
    first.send_signal(signal.SIGTERM)  # the warning, to the batch shell only (B:)
    out = "".join(lines) + first.communicate(timeout=300)[0]
    assert first.returncode == 0, out[-4000:]
    step = int(out.split("received SIGTERM at step ")[1].split(":")[0])
    assert 3 <= step < 30 and mr.latest_step(model_dir) == step, out[-4000:]
    assert "checkpoint saved; rerun the same command to resume" in out
    assert _scontrol(tmp_path) == ["requeue 1001"]
    assert not (model_dir / "result.json").exists()
    # Slurm requeues the job: the same script, from the top.
    second = subprocess.run(["bash", str(script)], env=dict(env, SLURM_RESTART_COUNT="1"), cwd=mr.ROOT,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert "requeued 1 time(s)" in second.stdout and f"resuming from step {step} " in second.stdout
    assert [r["step"] for r in mr.metrics(model_dir, "train")] == list(range(1, 31))
    assert mr.latest_step(model_dir) == 30 and (model_dir / "result.json").exists()
    assert _scontrol(tmp_path) == ["requeue 1001"]  # not requeued again: it finished


def test_single_run_script_starts_the_data_service_as_its_own_step_and_stops_it(tmp_path):
    # The training step here is a stand-in that prints the shards it was given: the
    # service's own step is real (2 shard processes, a dispatcher and a worker each).
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('shards:', os.environ['EXPFRAME_DATA_SERVICE'])\n")
    emitted = subprocess.run(
        [sys.executable, "-m", "expframe.launch", "--emit=slurm", "--workers=1", "--data_service_workers=2", "--",
         str(probe)], cwd=mr.ROOT, capture_output=True, text=True, timeout=60)
    assert emitted.returncode == 0, emitted.stderr
    assert "#SBATCH --ntasks=3" in emitted.stdout
    assert "srun --ntasks=1 --exact --kill-on-bad-exit=1" in emitted.stdout
    script = tmp_path / "run.sbatch"
    script.write_text(emitted.stdout)
    done = subprocess.run(["bash", str(script)], env=_slurm_env(tmp_path, SLURM_SUBMIT_DIR=str(tmp_path)),
                          cwd=mr.ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shards = done.stdout.split("shards: ")[1].split()[0].split(",")
    assert len(shards) == 2 and all(s.rsplit(":", 1)[1].isdigit() for s in shards), done.stdout
    assert f"expframe: tf.data service at {','.join(shards)}" in done.stdout
    assert not list(tmp_path.glob(".expframe_data_service.*"))  # removed on exit
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _shard_pids(tmp_path):
        time.sleep(0.1)
    assert not _shard_pids(tmp_path)


def _shard_pids(folder) -> list:
    """Shard processes whose address file lies under `folder`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if "--serve_data_shard" in cmdline and str(folder) in cmdline:
            pids.append(int(entry))
    return pids
