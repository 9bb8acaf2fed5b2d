"""expframe.processes: the one owner of child processes (no TensorFlow here)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from expframe import processes

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prints a line at once, then 1 MB (several pipes' worth) in 1 kB lines.
_FLOOD = "import sys\nprint('first', flush=True)\nfor _ in range(1024):\n    sys.stdout.write('x' * 1023 + '\\n')\n"
# Starts a `sleep` in its own (the child's) group, prints its pid and exits.
_LEAVE_A_SLEEP = "sleep 120 & echo $!"


def _gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(processes.group_alive(p) or processes.alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(30)
def test_a_child_that_prints_at_once_and_floods_never_blocks():
    lines = []
    with processes.Owner("test", guard=False) as owner:
        child = owner.start([sys.executable, "-c", _FLOOD], "flood", on_line=lambda c, line: lines.append(line))
        assert child in owner.children and child.pgid == child.pid
        assert child.wait(timeout=20) == 0
        owner.reap(child)
    assert lines[0] == b"first\n" and lines.count(b"x" * 1023 + b"\n") == 1024 and len(lines) == 1025
    assert os.getpgid(0) != child.pgid  # a session of its own


@pytest.mark.timeout(30)
def test_a_callback_that_raises_is_dropped_and_the_pipe_still_drains(capfd):
    calls = []

    def bad(child, line):
        calls.append(line)
        raise ValueError("cannot take this line")

    with processes.Owner("test", guard=False) as owner:
        child = owner.start([sys.executable, "-c", _FLOOD], "flood", on_line=bad)
        assert child.wait(timeout=20) == 0  # it would block on a full pipe if the reader had died
        owner.reap(child)
    assert calls == [b"first\n"]
    assert len(child.tail) == processes.TAIL_LINES and child.tail[-1] == "x" * 1023
    err = capfd.readouterr().err
    assert ("expframe: the output handler of flood failed (ValueError: cannot take this line); its further output "
            "is read and dropped") in err


@pytest.mark.timeout(30)
def test_the_group_of_an_exited_leader_is_still_stopped():
    lines = []
    with processes.Owner("test", guard=False) as owner:
        child = owner.start(["sh", "-c", _LEAVE_A_SLEEP], "leaves", on_line=lambda c, line: lines.append(line))
        assert child.wait(timeout=10) == 0
        child.join_output()
        sleeper = int(lines[0])
        assert processes.group_alive(child.pgid) and processes.alive(sleeper)  # sh is gone, its sleep is not
        assert owner.reap(child) == 0
        assert not processes.alive(sleeper) and not processes.group_alive(child.pgid)
        assert owner.children == []


@pytest.mark.timeout(30)
def test_stop_signals_the_group_then_sigkills_what_ignores_it():
    with processes.Owner("test", guard=False) as owner:
        stubborn = owner.start(["sh", "-c", "trap '' TERM; sleep 120 & wait"], "stubborn")
        polite = owner.start(["sleep", "120"], "polite")
        time.sleep(0.2)  # let sh set its trap
        started = time.monotonic()
        owner.stop(grace_s=0.5)
        assert time.monotonic() - started < 5
        assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
        assert not processes.group_alive(stubborn.pgid) and owner.children == []


# An owner process: starts a child whose group holds a grandchild `sleep`, prints the
# pids, and sleeps until killed.
_OWNER = textwrap.dedent("""
    import os, sys, time
    from expframe import processes
    owner = processes.Owner("test owner")
    lines = []
    child = owner.start(["sh", "-c", "sleep 120 & echo $!; wait"], "child", on_line=lambda c, l: lines.append(l))
    while not lines:
        time.sleep(0.01)
    print(os.getpid(), child.pid, int(lines[0]), flush=True)
    time.sleep(120)
""")


@pytest.mark.timeout(30)
def test_sigkill_of_the_owner_leaves_no_descendant():
    proc = subprocess.Popen([sys.executable, "-c", _OWNER], cwd=_REPO, stdout=subprocess.PIPE, text=True)
    owner_pid, child, grandchild = (int(p) for p in proc.stdout.readline().split())
    tree = processes.descendants(owner_pid)
    assert child in tree and grandchild in tree, tree  # and the guard
    proc.kill()
    proc.wait()
    try:
        assert _gone_within([child, grandchild], 3.0 + processes.GUARD_GRACE_S), \
            [p for p in (child, grandchild) if processes.alive(p)]
        assert _gone_within(list(tree), 2.0), {p: c for p, c in tree.items() if processes.alive(p)}  # the guard too
    finally:
        for pid in (child, grandchild):
            if processes.alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_describe_status():
    assert processes.describe_status(3) == "exited with status 3"
    assert processes.describe_status(-9) == "died with signal SIGKILL"


@pytest.mark.timeout(30)
def test_run_collects_the_output_and_a_timeout_stops_the_whole_group():
    done = processes.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                          "sys.exit(4)"], "short")
    assert (done.returncode, sorted(done.stdout.split())) == (4, ["err", "out"])
    with pytest.raises(subprocess.CalledProcessError):
        processes.run(["false"], "false", check=True)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        processes.run(["sh", "-c", "sleep 120 & echo $!; wait"], "slow", timeout=1.0)
    sleeper = int(e.value.output.split()[0])
    assert time.monotonic() - started < 1.0 + processes.GUARD_GRACE_S + 2
    assert not processes.alive(sleeper)
