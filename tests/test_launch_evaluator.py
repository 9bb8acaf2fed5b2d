"""`python -m expframe.launch --evaluator`: a sidecar `evaluator` task beside the cluster.

The evaluator's TF_CONFIG and command, and how the launcher treats it (a sidecar: waited
for after a finished training, its failure ends nothing, restarts leave it running,
signals reach it), with small stand-in programs and the launcher loaded by path (no
TensorFlow); the Slurm script's evaluator step, as text and run by bash with stand-ins
for srun and the program; and one real parameter_server run of main.py whose evaluator
evaluates every checkpoint.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from expframe import launch, processes
from tests import main_runner as mr

_REPO = mr.ROOT
_FAST = [sys.executable, "-c",
         "import importlib.util as u, sys; s = u.spec_from_file_location('launch', sys.argv[1]); "
         "m = u.module_from_spec(s); s.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))",
         os.path.join(_REPO, "expframe", "launch.py")]
_MODULE = [sys.executable, "-m", "expframe.launch"]

# argv: <how> <folder>. Reports its task; the evaluator then writes <folder>/evaluator_up
# (its SIGTERM handler is in place), which the workers wait for. The worker of index 0
# writes <folder>/final (its "final checkpoint") and exits; the evaluator waits for that
# file (or behaves as <how> says) and exits. Each says when SIGTERM reaches it.
_PROGRAM = textwrap.dedent("""
    import json, os, signal, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    task, how, folder = config["task"], sys.argv[1], sys.argv[2]
    restarts = int(os.environ["EXPFRAME_LAUNCH_RESTARTS"])
    print("TASK " + json.dumps({"task": task, "cluster": config["cluster"], "pid": os.getpid(),
                                "argv": sys.argv[1:], "restarts": restarts}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
    final = os.path.join(folder, "final")

    def wait_for(path):
        while not os.path.exists(path):
            time.sleep(0.05)

    if task["type"] == "evaluator":
        open(os.path.join(folder, "evaluator_up"), "w").close()  # its handler is in place
        if how == "eval_fails":
            open(os.path.join(folder, "eval_failed"), "w").close()
            sys.exit(3)
        print("ready", flush=True)
        if how in ("eval_hangs", "worker_fails"):
            time.sleep(120)
        wait_for(final)
        print("evaluated the final checkpoint", flush=True)
        sys.exit(0)
    wait_for(os.path.join(folder, "evaluator_up"))
    if how == "eval_fails":
        wait_for(os.path.join(folder, "eval_failed"))
        time.sleep(1.0)  # the launcher sees the evaluator's end while the training runs
    if how == "worker_fails" and task["index"] == 1:
        sys.exit(3)
    if how == "restart" and task["index"] == 1 and restarts == 0:
        time.sleep(0.3)
        sys.exit(3)
    if how == "sigterm":
        print("ready", flush=True)
        time.sleep(120)
    if how == "worker_fails":
        time.sleep(120)
    if task["index"] == 0:
        time.sleep(0.3)
        open(final, "w").close()
""")


def _program(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text(_PROGRAM)
    return str(path)


def _launch(args, timeout=60):
    return subprocess.run(_FAST + args, cwd=_REPO, capture_output=True, text=True, timeout=timeout)


def _tasks(stdout):
    """[(prefix, TASK record)] in the order printed."""
    found = []
    for line in stdout.splitlines():
        m = re.match(r"\[(worker \d+|chief|ps \d+|evaluator)\] TASK (.*)$", line)
        if m:
            found.append((m.group(1), json.loads(m.group(2))))
    return found


def _launcher_lines(stderr):
    return [re.sub(r"pid \d+", "pid N", line) for line in stderr.splitlines() if line.startswith("expframe.launch:")]


# -- (a) what the evaluator is given -----------------------------------------------------

def test_evaluator_tf_config_is_the_cluster_without_it_and_task_evaluator_0():
    for ps in (0, 1):
        cluster = launch.make_cluster(workers=2, ps=ps, host="127.0.0.1")
        assert launch.evaluator_config(cluster) == {"cluster": cluster, "task": {"type": "evaluator", "index": 0}}
    listed = {"worker": ["h:1"], "evaluator": ["h:2"]}
    assert launch.evaluator_config(listed)["cluster"] == {"worker": ["h:1"]}  # never in the cluster spec


@pytest.mark.parametrize("given, expected", [
    (["main.py", "--gin_file=q.gin"], ["main.py", "--gin_file=q.gin", "--mode=continuous_eval"]),
    (["main.py", "--mode=train", "--gin_file=q.gin"], ["main.py", "--gin_file=q.gin", "--mode=continuous_eval"]),
    (["main.py", "--mode", "train_and_eval", "-mode=eval", "--x=1"], ["main.py", "--x=1", "--mode=continuous_eval"]),
    (["expframe", "--gin_file=q.gin", "--", "--mode=x"], ["expframe", "--gin_file=q.gin", "--mode=continuous_eval",
                                                          "--", "--mode=x"]),
    (["main.py", "--model_dir=runs/--mode=train"], ["main.py", "--model_dir=runs/--mode=train",
                                                    "--mode=continuous_eval"]),
])
def test_evaluator_command_replaces_the_mode(given, expected):
    assert launch.evaluator_command(given) == expected


@pytest.mark.timeout(60)
def test_the_evaluator_runs_beside_the_workers_and_the_launcher_waits_for_it(tmp_path):
    prog = _program(tmp_path)
    proc = _launch(["--workers=2", "--evaluator", "--", prog, "ok", str(tmp_path), "--mode=train"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tasks = _tasks(proc.stdout)
    assert sorted(name for name, _ in tasks) == ["evaluator", "worker 0", "worker 1"]
    records = dict(tasks)
    evaluator, worker = records["evaluator"], records["worker 0"]
    assert evaluator["task"] == {"type": "evaluator", "index": 0}
    assert evaluator["cluster"] == worker["cluster"] and list(worker["cluster"]) == ["worker"]
    assert worker["argv"][-1] == "--mode=train"
    assert evaluator["argv"] == ["ok", str(tmp_path), "--mode=continuous_eval"]
    # It evaluated the final checkpoint before the launcher exited; nothing to say.
    assert "[evaluator] evaluated the final checkpoint" in proc.stdout
    assert _launcher_lines(proc.stderr) == [], proc.stderr
    assert processes.alive(evaluator["pid"]) is False


@pytest.mark.timeout(60)
def test_a_failed_evaluator_is_named_and_the_training_goes_on(tmp_path):
    prog = _program(tmp_path)
    proc = _launch(["--workers=2", "--evaluator", "--", prog, "eval_fails", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _launcher_lines(proc.stderr) == [
        "expframe.launch: evaluator (pid N) exited with status 3; the training goes on without it"], proc.stderr
    assert (tmp_path / "final").exists()  # the workers finished


@pytest.mark.timeout(60)
def test_an_evaluator_that_does_not_finish_is_stopped_after_the_wait(tmp_path):
    prog = _program(tmp_path)
    proc = _launch(["--workers=1", "--evaluator", "--evaluator_wait_s=1", "--", prog, "eval_hangs", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _launcher_lines(proc.stderr) == [
        "expframe.launch: evaluator (pid N) had not finished 1 s after the training (--evaluator_wait_s); "
        "stopped it with SIGTERM"], proc.stderr
    assert "[evaluator] got SIGTERM" in proc.stdout


@pytest.mark.timeout(90)
def test_a_restart_restarts_the_workers_only(tmp_path):
    prog = _program(tmp_path)
    proc = _launch(["--workers=2", "--max_restarts=1", "--grace_s=1", "--evaluator", "--", prog, "restart",
                    str(tmp_path)], timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tasks = _tasks(proc.stdout)
    assert sorted((name, record["restarts"]) for name, record in tasks) == [
        ("evaluator", 0), ("worker 0", 0), ("worker 0", 1), ("worker 1", 0), ("worker 1", 1)]
    assert "[evaluator] got SIGTERM" not in proc.stdout  # it ran through the restart
    assert "[evaluator] evaluated the final checkpoint" in proc.stdout
    lines = _launcher_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("expframe.launch: restart 1/1: worker 1 (pid N) exited with "
                                                   "status 3"), proc.stderr


@pytest.mark.timeout(60)
def test_a_cluster_that_fails_stops_its_evaluator(tmp_path):
    prog = _program(tmp_path)
    proc = _launch(["--workers=2", "--grace_s=1", "--evaluator", "--", prog, "worker_fails", str(tmp_path)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _launcher_lines(proc.stderr) == ["expframe.launch: worker 1 (pid N) exited with status 3; "
                                            "stopped the others"], proc.stderr
    assert "[evaluator] got SIGTERM" in proc.stdout
    assert not processes.alive(dict(_tasks(proc.stdout))["evaluator"]["pid"])


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_reaches_the_evaluator(tmp_path):
    prog = _program(tmp_path)
    proc = subprocess.Popen(_FAST + ["--workers=1", "--evaluator", "--", prog, "sigterm", str(tmp_path)],
                            cwd=_REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, ready = [], set()
    for line in proc.stdout:  # both installed their handler
        lines.append(line)
        if line.rstrip().endswith("] ready"):
            ready.add(line.split("]")[0])
        if len(ready) == 2:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    out = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "[worker 0] got SIGTERM" in out and "[evaluator] got SIGTERM" in out
    assert _launcher_lines(err) == ["expframe.launch: received SIGTERM; stopped all processes"], err
    assert all(not processes.alive(record["pid"]) for _, record in _tasks(out))


@pytest.mark.timeout(30)
def test_a_bad_evaluator_wait_is_one_line_and_exit_2():
    proc = _launch(["--workers=1", "--evaluator", "--evaluator_wait_s=-1", "--", "main.py"])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["python -m expframe.launch: error: --evaluator_wait_s=-1 must be > 0 "
                                        "(see --help)"], proc.stderr


# -- (a) the Slurm script -------------------------------------------------------------------

_COMMAND = ["main.py", "--gin_file=experiments/quickstart.gin", "--mode=train",
            "--gin_param=Replicator.target = 'multi_worker'"]


def _emit(*flags):
    proc = _launch(["--emit=slurm", "--workers=2", *flags, "--", *_COMMAND])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_slurm_script_runs_the_evaluator_as_a_step_of_its_own():
    plain, with_evaluator = _emit(), _emit("--evaluator", "--evaluator_wait_s=30")
    assert "#SBATCH --ntasks=2" in plain and "EVAL_ARGS" not in plain and "evaluator" not in plain
    assert 'srun --kill-on-bad-exit=1 "$PYTHON" "${ARGS[@]}" &' in plain
    lines = with_evaluator.splitlines()
    assert "#SBATCH --ntasks=3" in lines  # the workers and the evaluator
    assert ("ARGS=(main.py --gin_file=experiments/quickstart.gin --mode=train "
            "'--gin_param=Replicator.target = '\"'\"'multi_worker'\"'\"'')") in lines
    assert ("EVAL_ARGS=(main.py --gin_file=experiments/quickstart.gin "
            "'--gin_param=Replicator.target = '\"'\"'multi_worker'\"'\"'' --mode=continuous_eval)") in lines
    assert 'srun --ntasks=2 --exact --kill-on-bad-exit=1 "$PYTHON" "${ARGS[@]}" &' in lines
    assert ("TF_CONFIG='{\"cluster\": {}, \"task\": {\"type\": \"evaluator\", \"index\": 0}}' srun --ntasks=1 "
            "--nodes=1 --exact \"$PYTHON\" \"${EVAL_ARGS[@]}\" &") in lines
    assert any("-lt 30 ]" in line for line in lines)  # the bounded wait
    trap = next(line for line in lines if line.startswith("trap "))
    assert 'kill -TERM "$run_pid"' in trap and 'kill -TERM "$eval_pid"' in trap  # Slurm's warning reaches both
    assert lines[-1] == 'exit "$status"'  # the training's status


# Stand-ins: srun runs --ntasks=N copies (default $SLURM_NTASKS) with the step's variables;
# the "python" acts as a worker (exits 0 once the evaluator is up) or as the evaluator
# (exits with $EVAL_STATUS once the training ended).
_FAKE_SRUN = textwrap.dedent("""\
    #!/bin/bash
    n="${SLURM_NTASKS:-1}"
    while [[ "${1:-}" == --* ]]; do [[ "$1" == --ntasks=* ]] && n="${1#--ntasks=}"; shift; done
    pids=()
    for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_STEP_NUM_TASKS=$n "$@" & pids+=($!); done
    trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
    status=0
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
      wait "$pid"; s=$?; (( s > status )) && status=$s
    done
    exit "$status"
""")
_FAKE_PYTHON = textwrap.dedent("""\
    #!/bin/bash
    if [[ " $* " == *" --mode=continuous_eval "* ]]; then
      echo "evaluator: TF_CONFIG=$TF_CONFIG, $SLURM_STEP_NUM_TASKS task(s)"
      touch "$FOLDER/evaluator_up"
      while [ ! -e "$FOLDER/trained" ]; do sleep 0.05; done
      echo "evaluator: evaluated the final checkpoint"
      exit "$EVAL_STATUS"
    fi
    echo "worker $SLURM_PROCID of $SLURM_STEP_NUM_TASKS: $*"
    while [ ! -e "$FOLDER/evaluator_up" ]; do sleep 0.05; done
    [ "$SLURM_PROCID" = 0 ] && touch "$FOLDER/trained"
    exit 0
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eval_status", [0, 3])
def test_the_slurm_script_waits_for_the_evaluator_and_exits_with_the_trainings_status(tmp_path, eval_status):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("python", _FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "run.sbatch"
    script.write_text(_emit("--evaluator"))
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(bin_dir / "python"),
               FOLDER=str(tmp_path), EVAL_STATUS=str(eval_status), SLURM_JOB_ID="7", SLURM_NTASKS="3")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(["bash", str(script)], cwd=_REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert sorted(line.split(":")[0] for line in out if line.startswith("worker ")) == ["worker 0 of 2",
                                                                                        "worker 1 of 2"]
    assert 'evaluator: TF_CONFIG={"cluster": {}, "task": {"type": "evaluator", "index": 0}}, 1 task(s)' in out
    assert "evaluator: evaluated the final checkpoint" in out  # waited for, not stopped
    said = [line for line in out if line.startswith("expframe: the evaluator")]
    assert said == ([] if eval_status == 0 else [
        "expframe: the evaluator exited with status 3; the job's status is the training's (0)"]), proc.stdout


# -- (b) a real run: parameter servers, main.py's continuous_eval --------------------------

@pytest.mark.timeout(240)
def test_parameter_server_cluster_with_an_evaluator_evaluates_every_checkpoint(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    params = mr.SMALL + ("Replicator.target = 'parameter_server'", "resnet.norm = @BatchNormalization",
                         "Trainer.checkpoint_every_steps = 2")
    command = mr.args(["experiments/quickstart.gin"], model_dir, params, ["--mode=train", "--eval_timeout_s=120"])
    proc = subprocess.run(_MODULE + ["--workers=1", "--ps=1", "--evaluator", "--"] + command[1:], cwd=_REPO,
                          env=mr.env(data_dir), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "[chief] step 6/6" in proc.stdout, proc.stdout[-6000:]
    assert _launcher_lines(proc.stderr) == [], proc.stderr
    checkpoints = sorted(int(name[len("ckpt-"):-len(".index")]) for name in os.listdir(model_dir / "checkpoints")
                         if re.fullmatch(r"ckpt-\d+\.index", name))
    assert checkpoints == [2, 4, 6]
    evals = mr.metrics(model_dir, "eval")
    assert sorted(r["step"] for r in evals) == checkpoints, evals
    assert all(0.0 <= r["top1"] <= 1.0 for r in evals)
    for step in checkpoints:  # the evaluator's own lines
        assert re.search(rf"^\[evaluator\] eval at step {step}: loss ", proc.stdout, re.M), proc.stdout[-6000:]
