"""Multi-process targets end to end: `python -m expframe.launch` + main.py on 127.0.0.1.

Issue 5's acceptance: a 2-worker MultiWorkerMirroredStrategy run gives the same
losses as 2 local replicas, each example of an epoch is read by exactly one worker,
parameter_server trains, SIGTERM checkpoints and resumes, a dead worker fails the
run within seconds (a hung one: tests/test_recovery.py), and a bad TF_CONFIG is a configuration error.

Every test starts processes that import TensorFlow (seconds each on a small CPU),
so programs other than main.py are small scripts written into tmp_path.
"""

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
MULTI_WORKER = ("Replicator.target = 'multi_worker'", "Replicator.num_replicas = None")
LAUNCH = [sys.executable, "-m", "expframe.launch"]

# Reads one epoch (32 steps x 16 = 512 examples) and prints the ids this worker read.
_IDS_PROGRAM = textwrap.dedent('''
    import json, os, sys
    import tensorflow as tf
    import expframe
    from expframe.data import inputs
    data_dir = sys.argv[1]
    rep = expframe.Replicator("multi_worker")
    dist = rep.distribute(lambda ctx: inputs.shapes_input(
        "train", ctx, batch_size=ctx.get_per_replica_batch_size(16), training=True, seed=0,
        data_dir=data_dir, num_train=512, num_test=64), global_batch_size=16)
    it = iter(dist)
    step = tf.function(lambda batch: rep.run(lambda b: b["id"], batch))
    ids = []
    for _ in range(32):
        for local in rep.local_results(step(next(it))):
            ids.extend(int(i) for i in local.numpy().reshape(-1))
    print("IDS " + json.dumps({"worker": rep.worker_index, "pid": os.getpid(), "ids": ids}), flush=True)
''')

# All-reduces in a loop for up to argv[1] seconds, printing its pid and step.
_LOOP_PROGRAM = textwrap.dedent('''
    import os, sys, time
    import tensorflow as tf
    import expframe
    rep = expframe.Replicator("multi_worker")
    step = tf.function(lambda: rep.run(lambda: expframe.all_reduce(tf.ones([1000]), "sum")))
    deadline, i = time.time() + float(sys.argv[1]), 0
    while time.time() < deadline:
        total = float(rep.local_results(step())[0][0])
        print(f"STEP {i} pid {os.getpid()} sum {total}", flush=True)
        i += 1
        time.sleep(0.05)
''')


class Cluster:
    """`python -m expframe.launch` in the background: its lines, its children's pids, cleanup."""

    def __init__(self, launcher_args, program, data_dir, tmpdir=None, env=None):
        env = dict(mr.env(data_dir), **(env or {}))
        if tmpdir is not None:  # where non-chief workers make their private dirs
            env["TMPDIR"] = str(tmpdir)
        self.proc = subprocess.Popen(LAUNCH + list(launcher_args) + ["--"] + list(program), cwd=mr.ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.pids = {}  # "worker 0" -> pid, as found in /proc
        self.stopped = []

    def read_until(self, pattern, timeout):
        """Reads lines until one matches `pattern` (regex); returns the match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"{pattern!r} never appeared; output:\n{self.output[-6000:]}")

    def wait(self, timeout):
        """Waits for the launcher to exit; returns (status, all output)."""
        rest, _ = self.proc.communicate(timeout=timeout)
        self.lines.append(rest)
        return self.proc.returncode, self.output

    @property
    def output(self):
        return "".join(self.lines)

    def task_pids(self):
        """{"worker 0": pid, ...}: the launcher's children, by the TF_CONFIG task in their environment."""
        found = {}
        for pid in mr.child_pids(self.proc.pid, zombies=True):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except (OSError, ValueError, IndexError):
                continue
            if b"TF_CONFIG" not in env:  # the launcher's guard (expframe/processes.py) is a child too
                continue
            task = json.loads(env[b"TF_CONFIG"])["task"]
            found[f"{task['type']} {task['index']}"] = pid
        self.pids.update(found)
        return found

    def cleanup(self):
        """Leaves no process behind: continues stopped ones, kills the launcher's children."""
        if self.proc.poll() is None:
            self.task_pids()
            self.proc.send_signal(signal.SIGTERM)  # the launcher forwards it and reaps
            try:
                self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        for pid in list(self.pids.values()) + self.stopped:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture
def clusters():
    started = []
    yield lambda *a, **k: started.append(Cluster(*a, **k)) or started[-1]
    for c in started:
        c.cleanup()


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _main_program(tmp_path, model_dir, params, extra=()):
    """main.py's command line for the launcher."""
    return mr.args([QUICKSTART], model_dir, params, extra)[1:]


# -- cluster layout ----------------------------------------------------------------------

# Prints this process's identity as the Replicator sees it, after an all-reduce that
# proves the processes formed one cluster.
_IDENTITY_PROGRAM = textwrap.dedent('''
    import json, sys
    import gin
    import tensorflow as tf
    import expframe
    from expframe.replicator import targets
    gin.bind_parameter("slurm_cluster.port_base", int(sys.argv[1]))
    rep = expframe.Replicator("multi_worker", num_replicas=2)

    def step():
        return expframe.all_reduce(tf.cast(expframe.replica_id(), tf.float32) + 1.0, "sum")

    total = tf.function(lambda: rep.run(step))()
    record = {"index": rep.worker_index, "workers": rep.num_workers, "chief": rep.is_chief,
              "replicas": rep.num_replicas, "sum": float(rep.local_results(total)[0])}
    print("IDENTITY " + json.dumps(record), flush=True)
''')


def _consecutive_free_ports(count):
    from expframe import launch  # pylint: disable=import-outside-toplevel
    for _ in range(50):
        base = launch.free_ports("127.0.0.1", 1)[0]
        if base + count < 65536 and all(_port_is_free(base + i) for i in range(count)):
            return base
    raise AssertionError("no free consecutive ports")


def _port_is_free(port):
    import socket  # pylint: disable=import-outside-toplevel
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.timeout(200)
@pytest.mark.parametrize("resolver", ["slurm", "tf_config_with_chief"])
def test_worker_identity_comes_from_the_cluster_resolver(tmp_path, resolver):
    # Slurm is simulated by its environment alone (SlurmClusterResolver reads SLURM_*;
    # nothing calls scontrol or nvidia-smi): 2 tasks on one node, 127.0.0.1.
    prog = _write(tmp_path, "identity.py", _IDENTITY_PROGRAM)
    base = _consecutive_free_ports(2)
    envs = []
    for rank in range(2):
        env = mr.env(tmp_path)
        if resolver == "slurm":
            env.update(SLURM_JOB_ID="1", SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS="2",
                       SLURM_STEP_NODELIST="127.0.0.1", SLURM_STEP_TASKS_PER_NODE="2")
        else:  # the chief is worker 0, TF_CONFIG's worker 0 is worker 1
            cluster = {"chief": [f"127.0.0.1:{base}"], "worker": [f"127.0.0.1:{base + 1}"]}
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": ("chief", "worker")[rank],
                                                                         "index": 0}})
        envs.append(env)
    procs = [subprocess.Popen([sys.executable, prog, str(base)], cwd=mr.ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    records = []
    for rank, out in enumerate(outputs):
        assert procs[rank].returncode == 0, out[-3000:]
        assert "Replicator.num_replicas=2 is for the 'cpu' and 'gpu' targets; on 'multi_worker' the cluster " \
               "decides: 2 replica(s)" in out, out[-3000:]
        records.append(json.loads(re.search(r"^IDENTITY (.*)$", out, re.M).group(1)))
    assert records == [{"index": 0, "workers": 2, "chief": True, "replicas": 2, "sum": 3.0},
                       {"index": 1, "workers": 2, "chief": False, "replicas": 2, "sum": 3.0}], records


# -- synchronous training across processes ----------------------------------------------

# Slow (about 85 s): the same equality is in the default tests as the conformance matrix's
# 'classification | multi_worker x2 | float32' cell (tests/conformance/).
@pytest.mark.slow
@pytest.mark.timeout(540)
def test_two_workers_match_two_local_replicas_and_only_the_chief_writes(data_dir, tmp_path, clusters):
    # The cluster stops at step 3 and a rerun resumes to step 6: each worker must rebuild
    # its share of the input at the run's data position (in the chief's checkpoint), or
    # steps 4-6 differ.
    params = mr.SMALL + ("run_experiment.deterministic = True", "Trainer.log_every_steps = 1",
                         "Trainer.steps_per_loop = 1")
    local_dir, mw_dir, worker_tmp = tmp_path / "local", tmp_path / "mw", tmp_path / "worker_tmp"
    worker_tmp.mkdir()
    first = clusters(["--workers=2"], _main_program(tmp_path, mw_dir, params + MULTI_WORKER + (
        "Trainer.train_steps = 3", "Trainer.checkpoint_every_steps = 3"), ["--mode=train"]), data_dir,
        tmpdir=worker_tmp)
    local = mr.run([QUICKSTART], local_dir, data_dir, params + ("Replicator.num_replicas = 2",),
                   extra=["--mode=train"], timeout=400)
    status, out = first.wait(timeout=400)
    assert status == 0, out[-6000:]
    assert local.returncode == 0, local.stderr[-3000:]
    assert mr.latest_step(mw_dir) == 3
    assert not (mw_dir / "checkpoints" / "data").exists()  # no per-worker data files
    second = clusters(["--workers=2"], _main_program(tmp_path, mw_dir, params + MULTI_WORKER,
                                                     ["--mode=train", "--allow_config_change"]),
                      data_dir, tmpdir=worker_tmp)
    status, out = second.wait(timeout=400)
    assert status == 0, out[-6000:]
    assert "[worker 0] resuming from step 3" in out
    for worker in (0, 1):
        assert (f"[worker {worker}] expframe: data position carried over: 3 global batches, 48 examples consumed; "
                "the input restarts at global example 48") in out, out[-6000:]

    mw_rows, local_rows = mr.metrics(mw_dir, "train"), mr.metrics(local_dir, "train")
    assert [r["step"] for r in mw_rows] == [r["step"] for r in local_rows] == list(range(1, 7))
    mw_losses, local_losses = [r["loss"] for r in mw_rows], [r["loss"] for r in local_rows]
    np.testing.assert_allclose(mw_losses, local_losses, rtol=1e-5, atol=1e-5)
    assert len(set(np.round(local_losses, 5))) > 1, "losses did not change: nothing was trained"
    assert "target 'multi_worker', 2 replica(s)" in out
    # Only the chief (worker 0) printed progress and wrote the model_dir.
    assert "[worker 0] step 6/6" in out and "[worker 1] step" not in out
    assert json.loads((mw_dir / "result.json").read_text())["target"] == "multi_worker"
    assert sorted(p.name for p in mw_dir.iterdir()) == sorted(p.name for p in local_dir.iterdir())
    for split in ("train", "eval"):  # one TensorBoard writer per run (2 runs), not one per worker.
        if (mw_dir / split).exists():
            assert len(list((mw_dir / split).iterdir())) == 2, list((mw_dir / split).iterdir())
    others = [p for p in mw_dir.rglob("*worker*") if "data" not in p.relative_to(mw_dir).parts]
    assert not others, others
    assert mr.latest_step(mw_dir) == 6
    # Worker 1's private dir (expframe_worker1_*) was made under TMPDIR and removed.
    assert not list(worker_tmp.iterdir()), list(worker_tmp.iterdir())


@pytest.mark.timeout(240)
def test_each_example_of_an_epoch_is_read_by_exactly_one_worker(data_dir, tmp_path, clusters):
    prog = _write(tmp_path, "ids.py", _IDS_PROGRAM)
    cluster = clusters(["--workers=2"], [prog, str(data_dir)], data_dir)
    status, out = cluster.wait(timeout=220)
    assert status == 0, out[-6000:]
    records = {}
    for line in out.splitlines():
        m = re.match(r"\[worker (\d)\] IDS (.*)$", line)
        if m:
            records[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(records) == [0, 1], out[-6000:]
    assert [records[i]["worker"] for i in (0, 1)] == [0, 1]
    ids = [records[0]["ids"], records[1]["ids"]]
    assert len(ids[0]) == len(ids[1]) == 256
    assert not set(ids[0]) & set(ids[1])
    everything = ids[0] + ids[1]
    assert len(everything) == len(set(everything)) == 512
    assert sorted(everything) == list(range(512))


# -- one binding swaps the hardware --------------------------------------------------------

# The quickstart shrunk to seconds by bindings; its global batch (120), model and
# Replicator bindings (num_replicas = 2 included) stay as shipped.
QUICKSTART_SHRUNK = ("shapes_input.num_train = 512", "shapes_input.num_test = 64", "Trainer.train_steps = 2",
                     "Trainer.steps_per_loop = 2", "Trainer.log_every_steps = 2", "Trainer.eval_every_steps = None",
                     "Trainer.checkpoint_every_steps = 2")


def _readme_command(target, model_dir, params=()):
    """README's launcher example's program: main.py, the quickstart, the target binding."""
    return (["main.py", f"--gin_file={QUICKSTART}", f"--gin_param=Replicator.target='{target}'"]
            + [f"--gin_param={p}" for p in QUICKSTART_SHRUNK + tuple(params)] + [f"--model_dir={model_dir}"])


# Slow (about 55 s): the launcher runs in the default tests through test_extending_doc.py.
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_launcher_example_with_3_workers(data_dir, tmp_path, clusters):
    model_dir = tmp_path / "run"
    cluster = clusters(["--workers=3"], _readme_command("multi_worker", model_dir), data_dir)
    status, out = cluster.wait(timeout=380)
    assert status == 0, out[-6000:]
    for i in range(3):  # the quickstart's Replicator.num_replicas = 2 does not get in the way
        assert (f"[worker {i}] expframe: Replicator.num_replicas=2 is for the 'cpu' and 'gpu' targets; "
                "on 'multi_worker' the cluster decides: 3 replica(s)") in out, out[-6000:]
    assert "[worker 0] model_dir" in out and "target 'multi_worker', 3 replica(s), global batch 120" in out
    result = json.loads((model_dir / "result.json").read_text())
    assert (result["step"], result["target"], result["num_replicas"], result["global_batch_size"]) == (
        2, "multi_worker", 3, 120)
    assert 0.0 <= result["eval"]["top1"] <= 1.0
    assert all(np.isfinite(r["loss"]) for r in mr.metrics(model_dir, "train"))


@pytest.mark.timeout(300)
def test_quickstart_on_parameter_servers_names_the_norm_binding_to_change(data_dir, tmp_path, clusters):
    # SyncBatchNorm cannot work asynchronously: refused while the model is built, before
    # any step is traced, as one line and exit 2, with nothing written.
    model_dir = tmp_path / "run"
    cluster = clusters(["--workers=1", "--ps=1"], _readme_command("parameter_server", model_dir), data_dir)
    status, out = cluster.wait(timeout=280)
    assert status == 2, out[-6000:]
    errors = [line for line in out.splitlines() if line.startswith("[chief] error:")]
    assert errors == ["[chief] error: SyncBatchNorm cannot synchronise under Replicator.target='parameter_server' "
                      "(workers step asynchronously: there is no global batch); use resnet.norm = "
                      "@BatchNormalization (per-worker statistics) for that target."], out[-6000:]
    assert "Traceback" not in out and "StagingError" not in out, out[-6000:]
    assert re.search(r"expframe.launch: chief \(pid \d+\) exited with status 2", out), out[-3000:]
    assert not model_dir.exists() or not any(model_dir.iterdir())


# -- parameter servers --------------------------------------------------------------------

@pytest.mark.timeout(420)
def test_parameter_server_trains(data_dir, tmp_path, clusters):
    model_dir = tmp_path / "ps"
    # The target and the norm layer: the two bindings the quickstart needs for this target.
    params = mr.SMALL + ("Replicator.target = 'parameter_server'",
                         "resnet.norm = @BatchNormalization", "Trainer.train_steps = 400",
                         "Trainer.global_batch_size = 32",
                         "Trainer.steps_per_loop = 20", "Trainer.log_every_steps = 20",
                         "keras.optimizers.Adam.learning_rate = 5e-3", "Trainer.checkpoint_every_steps = 400")
    cluster = clusters(["--ps=1", "--workers=2"], _main_program(tmp_path, model_dir, params), data_dir)
    status, out = cluster.wait(timeout=400)
    assert status == 0, out[-6000:]
    assert "[chief] step 400/400" in out, out[-6000:]
    train = mr.metrics(model_dir, "train")
    assert [r["step"] for r in train] == list(range(20, 401, 20))
    assert all(np.isfinite(r["loss"]) for r in train)
    first, last = np.mean([r["loss"] for r in train[:3]]), np.mean([r["loss"] for r in train[-3:]])
    assert last < first - 0.1, [r["loss"] for r in train]
    result = json.loads((model_dir / "result.json").read_text())
    assert (result["step"], result["target"]) == (400, "parameter_server")
    assert 0.0 <= result["eval"]["top1"] <= 1.0
    assert mr.latest_step(model_dir) == 400


# -- preemption and failures --------------------------------------------------------------

@pytest.mark.timeout(480)
def test_sigterm_to_the_chief_checkpoints_and_the_rerun_resumes(data_dir, tmp_path, clusters):
    model_dir = tmp_path / "run"
    params = mr.SMALL + MULTI_WORKER + ("Trainer.train_steps = 100000", "Trainer.steps_per_loop = 1",
                                        "Trainer.log_every_steps = 1", "Trainer.checkpoint_every_steps = 100000")
    program = _main_program(tmp_path, model_dir, params, ["--mode=train"])
    steps = []
    for attempt in range(2):
        cluster = clusters(["--workers=2"], program, data_dir)
        if attempt:
            cluster.read_until(rf"\[worker 0\] resuming from step {steps[0]} ", timeout=300)
        cluster.read_until(r"\[worker 0\] step \d+/100000", timeout=300)
        chief = cluster.task_pids()["worker 0"]
        os.kill(chief, signal.SIGTERM)  # the chief alone: the workers must agree to stop.
        status, out = cluster.wait(timeout=120)
        assert status == 0, out[-6000:]
        m = re.search(r"\[worker 0\] received SIGTERM at step (\d+): checkpoint saved; "
                      r"rerun the same command to resume", out)
        assert m, out[-6000:]
        steps.append(int(m.group(1)))
        assert mr.latest_step(model_dir) == steps[-1]
        assert not (model_dir / "result.json").exists()
    assert steps[1] > steps[0]
    train_steps = [r["step"] for r in mr.metrics(model_dir, "train")]
    assert train_steps == list(range(1, steps[1] + 1))


def _start_and_signal_worker_1(tmp_path, data_dir, clusters, sig):
    """2 workers all-reducing in a loop; `sig` to worker 1. Returns (cluster, victim pid, when).

    (A SIGSTOPped worker under main.py: tests/test_recovery.py.)"""
    prog = _write(tmp_path, "loop.py", _LOOP_PROGRAM)
    cluster = clusters(["--workers=2", "--heartbeat_timeout_s=5", "--grace_s=1"], [prog, "300"], data_dir)
    m = cluster.read_until(r"\[worker 1\] STEP 3 pid (\d+)", timeout=200)
    victim = int(m.group(1))
    cluster.pids["worker 1"] = victim
    if sig == signal.SIGSTOP:
        cluster.stopped.append(victim)
    os.kill(victim, sig)
    return cluster, victim, time.monotonic()


@pytest.mark.timeout(300)
def test_a_killed_worker_fails_the_run_within_10s(data_dir, tmp_path, clusters):
    cluster, victim, killed = _start_and_signal_worker_1(tmp_path, data_dir, clusters, signal.SIGKILL)
    status, out = cluster.wait(timeout=60)
    elapsed = time.monotonic() - killed
    print(f"worker 1 SIGKILL -> launcher exit: {elapsed:.2f} s")
    assert status == 1, out[-4000:]
    assert re.search(rf"expframe.launch: worker 1 \(pid {victim}\) died with signal SIGKILL; stopped the others",
                     out), out[-4000:]
    assert elapsed < 10, f"{elapsed:.1f} s"


# -- configuration ------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_bad_tf_config_is_a_configuration_error(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    args = mr.args([QUICKSTART], model_dir, mr.SMALL + MULTI_WORKER)
    done = subprocess.run(args, cwd=mr.ROOT, env=dict(mr.env(data_dir), TF_CONFIG="not json"),
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "TF_CONFIG is not a valid cluster description" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not model_dir.exists() or not any(model_dir.iterdir())
