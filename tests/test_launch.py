"""`python -m expframe.launch`: cluster layout, log prefixes, failure handling, real MWMS run.

Most tests load `expframe/launch.py` by path (`_FAST`), so the launcher process does not
import the `expframe` package and TensorFlow (seconds each on a small CPU); the one real
multi-worker run goes through the public entry point `python -m expframe.launch`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from expframe import launch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_PY = os.path.join(_REPO, "expframe", "launch.py")
_FAST = [sys.executable, "-c",
         "import importlib.util as u, sys; s = u.spec_from_file_location('launch', sys.argv[1]); "
         "m = u.module_from_spec(s); s.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))",
         _LAUNCH_PY]
_MODULE = [sys.executable, "-m", "expframe.launch"]

# A program that reports its task and pid, then behaves as argv[1] says.
_PROGRAM = textwrap.dedent("""
    import json, os, signal, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    print("TASK " + json.dumps({"task": config["task"], "cluster": config["cluster"], "pid": os.getpid()}))
    print("to stderr", file=sys.stderr)
    sys.stdout.flush()
    mode = sys.argv[1]
    if mode == "exit" and index == 1:
        sys.exit(int(sys.argv[2]))
    if mode == "sigkill":
        if index == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    if mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
""")

# A real 2-worker MultiWorkerMirroredStrategy all-reduce through the Replicator.
_MWMS_PROGRAM = textwrap.dedent("""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import expframe
    from expframe.replicator import cluster
    print("fault detection configured:", cluster.configure_fault_detection(), flush=True)
    rep = expframe.Replicator("multi_worker")

    def step():
        return expframe.all_reduce(tf.cast(expframe.replica_id(), tf.float32) + 1.0, "sum")

    @tf.function
    def replicated():
        return rep.run(step)

    print("ALLREDUCE", float(rep.local_results(replicated())[0]), flush=True)
""")


def _write(tmp_path, text, name="prog.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _launch(launcher, args, timeout=30):
    start = time.monotonic()
    proc = subprocess.run(launcher + args, cwd=_REPO, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _tasks(stdout):
    """{prefix: TASK record} from the program's TASK lines."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\[(worker \d+|chief|ps \d+)\] TASK (.*)$", line)
        if m:
            found[m.group(1)] = json.loads(m.group(2))
    return found


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
def test_all_succeed_prefixes_and_distinct_tasks(tmp_path):
    prog = _write(tmp_path, _PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=3", "--", prog, "ok"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tasks = _tasks(proc.stdout)
    assert sorted(tasks) == ["worker 0", "worker 1", "worker 2"]
    for name, record in tasks.items():
        assert record["task"] == {"type": "worker", "index": int(name.split()[1])}
    clusters = [record["cluster"] for record in tasks.values()]
    assert all(c == clusters[0] for c in clusters)
    addresses = clusters[0]["worker"]
    assert list(clusters[0]) == ["worker"] and len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for i in range(3):  # the children's stderr is prefixed too.
        assert f"[worker {i}] to stderr" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("child_status, launcher_status", [(3, 1), (2, 2)])
def test_failing_worker_stops_the_others(tmp_path, child_status, launcher_status):
    prog = _write(tmp_path, _PROGRAM)
    proc, elapsed = _launch(_FAST, ["--workers=2", "--", prog, "exit", str(child_status)])
    assert proc.returncode == launcher_status, proc.stdout + proc.stderr
    assert elapsed < 10
    lines = [line for line in proc.stderr.splitlines() if line.startswith("expframe.launch:")]
    assert len(lines) == 1, proc.stderr
    assert re.match(rf"expframe.launch: worker 1 \(pid \d+\) exited with status {child_status}; "
                    r"stopped the others$", lines[0]), lines[0]


@pytest.mark.timeout(60)
def test_killed_worker_stops_a_sleeping_one(tmp_path):
    prog = _write(tmp_path, _PROGRAM)
    proc, elapsed = _launch(_FAST, ["--workers=2", "--grace_s=1", "--", prog, "sigkill"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 10
    assert re.search(r"expframe.launch: worker 1 \(pid \d+\) died with signal SIGKILL; stopped the others",
                     proc.stderr), proc.stderr
    assert _gone(_tasks(proc.stdout)["worker 0"]["pid"])


@pytest.mark.timeout(60)
def test_sigterm_is_forwarded(tmp_path):
    prog = _write(tmp_path, _PROGRAM)
    proc = subprocess.Popen(_FAST + ["--workers=2", "--", prog, "term"], cwd=_REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, lines = 0, []
    for line in proc.stdout:  # wait until both children installed their handler.
        lines.append(line)
        ready += line.rstrip().endswith("] ready")
        if ready == 2:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    out = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "[worker 0] got SIGTERM" in out and "[worker 1] got SIGTERM" in out
    assert "received SIGTERM" in err
    assert all(_gone(r["pid"]) for r in _tasks(out).values())


@pytest.mark.timeout(30)
def test_usage_errors_exit_2():
    proc, _ = _launch(_FAST, ["--workers=2"])
    assert proc.returncode == 2 and "no program given" in proc.stderr


def test_cluster_layout():
    cluster = launch.make_cluster(workers=2, ps=1, host="127.0.0.1")
    assert list(cluster) == ["chief", "worker", "ps"]
    assert [len(cluster[r]) for r in cluster] == [1, 2, 1]
    addresses = [a for role in cluster.values() for a in role]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert list(launch.make_cluster(workers=2, ps=0, host="127.0.0.1")) == ["worker"]
    assert launch.program_command(["main.py", "--x=1"]) == [sys.executable, "main.py", "--x=1"]
    assert launch.program_command(["echo", "a.py"]) == ["echo", "a.py"]


@pytest.mark.timeout(150)
def test_multi_worker_mirrored_all_reduce(tmp_path):
    prog = _write(tmp_path, _MWMS_PROGRAM)
    proc, _ = _launch(_MODULE, ["--workers=2", "--heartbeat_timeout_s=3", "--", prog], timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i in range(2):
        assert f"[worker {i}] fault detection configured: True" in proc.stdout
        assert f"[worker {i}] ALLREDUCE 3.0" in proc.stdout, proc.stdout[-3000:]


def test_heartbeat_constants_match_the_replicator():
    from expframe import launch
    from expframe.replicator import cluster
    assert (launch.HEARTBEAT_ENV, launch.DEFAULT_HEARTBEAT_TIMEOUT_S) == (
        cluster.HEARTBEAT_ENV, cluster.DEFAULT_HEARTBEAT_TIMEOUT_S)
