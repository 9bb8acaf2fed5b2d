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

from expframe import launch, processes

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
    def shards_serving():  # whether every data service shard (if any) still takes connections
        import socket
        for address in filter(None, os.environ.get("EXPFRAME_DATA_SERVICE", "").split(",")):
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
            except OSError:
                return False
        return True
    def on_term(*_):
        time.sleep(0.5)  # what a worker finishing its step does; a shard signalled with it has ended by now
        print("got SIGTERM; shards serving:", shards_serving(), flush=True)
        sys.exit(0)
    if mode == "term":
        signal.signal(signal.SIGTERM, on_term)
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


@pytest.mark.timeout(90)
def test_sigterm_is_forwarded(tmp_path):
    """To the workers, and to a data service shard only once they are gone: a worker that
    finishes its step after the signal may still wait for that step's batch."""
    prog = _write(tmp_path, _PROGRAM)
    proc = subprocess.Popen(_FAST + ["--workers=2", "--data_service_workers=1", "--", prog, "term"], cwd=_REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, lines = 0, []
    for line in proc.stdout:  # wait until both children installed their handler.
        lines.append(line)
        ready += line.rstrip().endswith("] ready")
        if ready == 2:
            break
    below = processes.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    out = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "[worker 0] got SIGTERM; shards serving: True" in out, out + err
    assert "[worker 1] got SIGTERM; shards serving: True" in out, out + err
    assert "received SIGTERM" in err
    assert any("--serve_data_shard" in c for c in below.values()), below
    assert all(_gone(pid) for pid in below), below  # the shard too
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
    # The coordination service's shutdown abort (1 of 2 clean runs printed it) is held back.
    assert "StartAbort" not in proc.stdout + proc.stderr and "tasks have crashed" not in proc.stdout


def test_heartbeat_constants_match_the_replicator():
    from expframe import launch
    from expframe.replicator import cluster
    assert (launch.HEARTBEAT_ENV, launch.DEFAULT_HEARTBEAT_TIMEOUT_S) == (
        cluster.HEARTBEAT_ENV, cluster.DEFAULT_HEARTBEAT_TIMEOUT_S)


# -- restarts (--max_restarts) and fewer workers (--min_workers) ------------------------

# Reports its slot, restart count and cluster, then acts as the chief of a resumed run
# (main.py's lines) and behaves as argv[1] says for the worker in slot 1.
_RESTART_PROGRAM = textwrap.dedent("""
    import json, os, signal, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    slot, restarts = int(os.environ["EXPFRAME_LAUNCH_SLOT"]), int(os.environ["EXPFRAME_LAUNCH_RESTARTS"])
    print("START " + json.dumps({"slot": slot, "restarts": restarts, "index": config["task"]["index"],
                                 "workers": len(config["cluster"]["worker"]), "pid": os.getpid()}), flush=True)
    mode = sys.argv[1]
    if slot == 1 and mode == "config":
        sys.exit(2)
    if slot == 1 and (mode == "always" or (restarts == 0 and mode == "once")):
        time.sleep(0.3)
        sys.exit(3)
    if slot == 1 and mode == "gone":  # killed once, then fails at once: its machine is gone
        if restarts:
            sys.exit(1)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    if config["task"]["index"] == 0:
        time.sleep(1.0)  # a chief restores after the others started
        if restarts:
            print("expframe: data position carried over: 7 global batches, 112 examples consumed; the input "
                  "restarts at global example 112", flush=True)
            print("resuming from step 7 (ckpt; restored in 0.01 s)", flush=True)
        print("model_dir d: target 'multi_worker', 2 replica(s), global batch 16, 9 steps", flush=True)
    time.sleep(1.0 if mode != "gone" or restarts < 2 else 0.2)
""")


def _starts(stdout):
    return [json.loads(line.split("START ", 1)[1]) for line in stdout.splitlines() if "] START " in line]


def _launcher_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("expframe.launch:")]


@pytest.mark.timeout(90)
def test_a_failed_worker_is_restarted_and_the_line_says_where_it_resumed(tmp_path):
    prog = _write(tmp_path, _RESTART_PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=2", "--max_restarts=2", "--grace_s=1", "--", prog, "once"], timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = _starts(proc.stdout)
    assert sorted((s["restarts"], s["slot"], s["index"], s["workers"]) for s in starts) == [
        (0, 0, 0, 2), (0, 1, 1, 2), (1, 0, 0, 2), (1, 1, 1, 2)]
    failed = next(s["pid"] for s in starts if s["restarts"] == 0 and s["slot"] == 1)
    lines = _launcher_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(rf"expframe.launch: restart 1/2: worker 1 \(pid {failed}\) exited with status 3; "
                        r"resumed from step 7; data position carried over: 7 global batches, 112 examples "
                        r"consumed, \d+\.\d\d s after the failure; 1 restart\(s\) left", lines[0]), lines[0]


@pytest.mark.timeout(90)
def test_after_max_restarts_the_launcher_exits_1(tmp_path):
    prog = _write(tmp_path, _RESTART_PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=2", "--max_restarts=2", "--grace_s=1", "--", prog, "always"], timeout=80)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted({s["restarts"] for s in _starts(proc.stdout)}) == [0, 1, 2]
    lines = _launcher_lines(proc.stderr)
    assert len(lines) == 3, proc.stderr
    for k in (1, 2):  # each restarted cluster failed again, before its chief resumed
        assert re.fullmatch(rf"expframe.launch: restart {k}/2: worker 1 \(pid \d+\) exited with status 3; "
                            r"the restarted cluster failed without reporting where it resumed; "
                            rf"{2 - k} restart\(s\) left", lines[k - 1]), lines[k - 1]
    assert re.fullmatch(r"expframe.launch: worker 1 \(pid \d+\) exited with status 3; stopped the others; "
                        r"no restarts left \(--max_restarts=2\)", lines[2]), lines[2]


@pytest.mark.timeout(60)
def test_a_configuration_error_is_never_restarted(tmp_path):
    prog = _write(tmp_path, _RESTART_PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=2", "--max_restarts=3", "--grace_s=1", "--", prog, "config"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert {s["restarts"] for s in _starts(proc.stdout)} == {0}
    assert [re.sub(r"pid \d+", "pid N", line) for line in _launcher_lines(proc.stderr)] == [
        "expframe.launch: worker 1 (pid N) exited with status 2; stopped the others"]


@pytest.mark.timeout(90)
def test_a_worker_that_cannot_be_restarted_is_dropped_down_to_min_workers(tmp_path):
    prog = _write(tmp_path, _RESTART_PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=3", "--max_restarts=3", "--min_workers=2", "--grace_s=1", "--", prog,
                              "gone"], timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = sorted((s["slot"], s["index"], s["workers"]) for s in _starts(proc.stdout) if s["restarts"] == 2)
    assert final == [(0, 0, 2), (2, 1, 2)]  # slot 2 is now worker 1 of 2
    lines = [re.sub(r"pid \d+", "pid N", re.sub(r"\d+\.\d\d s after", "T s after", line))
             for line in _launcher_lines(proc.stderr)]
    assert lines == [
        "expframe.launch: restart 1/3: worker 1 (pid N) died with signal SIGKILL; the restarted cluster failed "
        "without reporting where it resumed; 2 restart(s) left",
        "expframe.launch: restart 2/3: worker 1 (pid N) exited with status 1; worker slot 1 failed again before "
        "the cluster resumed, so it cannot be restarted: continuing on 2 of 3 workers (--min_workers=2; the global "
        "batch is unchanged, each worker's share grows); resumed from step 7; data position carried over: 7 global "
        "batches, 112 examples consumed, T s after the failure; 1 restart(s) left"], proc.stderr


@pytest.mark.timeout(90)
def test_without_min_workers_a_worker_that_cannot_be_restarted_ends_the_run(tmp_path):
    prog = _write(tmp_path, _RESTART_PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=2", "--max_restarts=2", "--grace_s=1", "--", prog, "gone"], timeout=80)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert all(s["workers"] == 2 for s in _starts(proc.stdout))
    assert _launcher_lines(proc.stderr)[-1].endswith("exited with status 1; stopped the others; "
                                                     "no restarts left (--max_restarts=2)"), proc.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, message", [
    (["--workers=2", "--min_workers=3", "--max_restarts=1"], "--min_workers=3 must be between 1 and --workers=2"),
    (["--workers=2", "--min_workers=1"], "--min_workers takes effect on a restart: give --max_restarts >= 1 too"),
    (["--workers=2", "--max_restarts=-1"], "--max_restarts=-1 must be >= 0"),
])
def test_restart_flags_are_checked(args, message):
    proc, _ = _launch(_FAST, args + ["--", "prog.py"])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# -- one owner for every child: the hang, a signal during a restart, orphans -----------------

# The launcher loaded by path, with every thread start followed by 0.3 s in the starting
# thread: a reader thread runs before its starter continues, as on a loaded machine.
_SLOW_STARTS = [sys.executable, "-c",
                "import importlib.util as u, sys, threading, time; s0 = threading.Thread.start\n"
                "def start(self):\n    s0(self); time.sleep(0.3)\n"
                "threading.Thread.start = start\n"
                "s = u.spec_from_file_location('launch', sys.argv[1]); m = u.module_from_spec(s); "
                "s.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))", _LAUNCH_PY]

# Prints a line at once, then 1 MB (more than a pipe holds) in 1 kB lines, then its pid.
_FLOOD_PROGRAM = textwrap.dedent("""
    import os, sys
    sys.stdout.write("first\\n"); sys.stdout.flush()
    for i in range(1024):
        sys.stdout.write("x" * 1023 + "\\n")
    sys.stdout.write("done " + str(os.getpid()) + "\\n")
""")


@pytest.mark.timeout(60)
def test_a_worker_that_prints_at_once_and_floods_its_pipe_never_blocks(tmp_path):
    # The old launcher started a worker's reader before it listed the worker: its first
    # line raised IndexError in the reader, the pipe was never drained and the worker
    # blocked once it was full (the launcher hung).
    prog = _write(tmp_path, _FLOOD_PROGRAM)
    proc, _ = _launch(_SLOW_STARTS, ["--workers=3", "--", prog], timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for i in range(3):
        assert proc.stdout.count(f"[worker {i}] " + "x" * 1023 + "\n") == 1024
        assert re.search(rf"^\[worker {i}\] first$", proc.stdout, re.M)
        assert re.search(rf"^\[worker {i}\] done \d+$", proc.stdout, re.M)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


# Worker 1 fails at once; worker 0 takes 2 s to stop on SIGTERM (saying so first).
_SLOW_STOP_PROGRAM = textwrap.dedent("""
    import json, os, signal, sys, time
    restarts = int(os.environ["EXPFRAME_LAUNCH_RESTARTS"])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print("START " + json.dumps({"restarts": restarts, "index": index, "pid": os.getpid()}), flush=True)
    if index == 1:
        time.sleep(0.5)
        sys.exit(3)
    def stopping(*_):
        print("stopping", flush=True)
        time.sleep(2.0)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopping)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_a_signal_while_a_failed_cluster_is_stopped_cancels_the_restart(tmp_path):
    # The old launcher started the restarted cluster anyway, never signalled it, and
    # SIGKILLed it 10 s later.
    prog = _write(tmp_path, _SLOW_STOP_PROGRAM)
    proc = subprocess.Popen(_FAST + ["--workers=2", "--max_restarts=2", "--grace_s=5", "--", prog], cwd=_REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:  # the failed cluster is being stopped: worker 0 got SIGTERM
        lines.append(line)
        if line.startswith("[worker 0] stopping"):
            break
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    out = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert time.monotonic() - sent < 8
    assert {s["restarts"] for s in _starts(out)} == {0}, out  # no second cluster
    assert _launcher_lines(err) == ["expframe.launch: received SIGTERM; stopped all processes"], err


# Starts a `sleep` in its own process group and prints its pid; then exits (argv[1] ==
# "exit") or sleeps.
_PARENT_PROGRAM = textwrap.dedent("""
    import os, subprocess, sys, time
    sleeper = subprocess.Popen(["sleep", "120"])
    print("PIDS", os.getpid(), sleeper.pid, flush=True)
    if sys.argv[1] != "exit":
        time.sleep(120)
""")


def _pids(stdout):
    return [int(p) for line in stdout.splitlines() if "] PIDS " in line for p in line.split("] PIDS ")[1].split()]


def _all_gone(pids, within_s):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(processes.alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(60)
def test_what_a_finished_worker_left_in_its_group_ends_with_the_launcher(tmp_path):
    prog = _write(tmp_path, _PARENT_PROGRAM)
    proc, _ = _launch(_FAST, ["--workers=2", "--", prog, "exit"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = _pids(proc.stdout)
    assert len(pids) == 4, proc.stdout
    assert _all_gone(pids, 1.0), [p for p in pids if not _gone(p)]  # the old launcher left both sleeps


@pytest.mark.timeout(60)
def test_sigkill_of_the_launcher_leaves_no_worker(tmp_path):
    prog = _write(tmp_path, _PARENT_PROGRAM)
    proc = subprocess.Popen(_FAST + ["--workers=2", "--", prog, "stay"], cwd=_REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if len(_pids("".join(out))) == 4:
            break
    pids = _pids("".join(out))
    proc.kill()
    proc.wait()
    try:
        assert _all_gone(pids, 8.0), [p for p in pids if not _gone(p)]  # the old launcher left all four
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


_ABORT_LINE = ("E0000 00:00:1764000000.000000   1 coordination_service_agent.cc:332] Coordination agent is set to "
               "ERROR: UNAVAILABLE: failed to connect ... StartAbort UNAVAILABLE: The tasks have crashed. Check the "
               "task logs for an earlier error")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [0, 3])
def test_the_coordination_services_shutdown_abort_shows_only_when_the_cluster_failed(tmp_path, status):
    prog = _write(tmp_path, f"import sys\nprint({_ABORT_LINE!r}, file=sys.stderr)\nsys.exit({status})\n")
    proc, _ = _launch(_FAST, ["--workers=2", "--", prog])
    assert proc.returncode == (0 if status == 0 else 1), proc.stdout + proc.stderr
    shown = proc.stdout.count("StartAbort UNAVAILABLE: The tasks have crashed")
    # A failed cluster shows what its workers printed; the second worker may be stopped
    # (the first one's failure) before it printed its line, so at least one.
    assert (shown == 0) if status == 0 else (shown >= 1), proc.stdout
