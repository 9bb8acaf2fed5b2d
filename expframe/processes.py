"""The one owner of child processes: start each in a session of its own, drain its
output, forward signals, and take every group it started down with it.

Every long-lived child expframe starts (launcher workers, study runs, actor processes,
render workers, benchmark workers) goes through an `Owner`:

* **Its own session.** Each child starts with `setsid` (`start_new_session=True`), so
  its process group is its own: a terminal's Ctrl-C, GNU `timeout` or `kill -- -PGID`
  sent to the owner's group reaches the owner only, and the owner decides what the
  children get (`Owner.signal`). A render worker no longer dies before the learner
  has saved its checkpoint.
* **Registered before its output is read.** The child is in `Owner.children` before the
  reader thread starts, and the reader catches whatever a line callback raises (the
  callback is dropped, with one line on stderr, and the pipe is still drained): a child
  that prints at once, or prints a line the callback cannot take, never blocks on a
  full pipe.
* **Gone with the owner.** `Owner.stop` and `Owner.close` signal a child's whole process
  group, whether or not the child itself is still alive (its own children, in its
  group, would otherwise be left with parent 1), and SIGKILL what is left after a
  grace. `close` runs at interpreter exit too. When the owner dies without running any
  Python (SIGKILL, a crash), a small guard process, started with the first child, reads
  a pipe from the owner: at end of file it sends SIGTERM to every group still on its
  list, then SIGKILL after `GUARD_GRACE_S`.

The module imports no TensorFlow (the launcher starts in a fraction of a second).

    owner = Owner("expframe.launch")
    child = owner.start([sys.executable, "main.py", ...], name="worker 0",
                        on_line=lambda child, line: print(b"[worker 0] " + line))
    owner.signal(signal.SIGTERM)        # to every child's group
    owner.stop(grace_s=3.0)             # SIGTERM, wait, SIGKILL the rest; joins the readers
"""

import atexit
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from signal import SIGKILL, SIGTERM
from typing import Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence

GUARD_GRACE_S = 3.0
TAIL_LINES = 200
KILL_WAIT_S = 5.0  # the longest `Owner.stop` waits for SIGKILLed processes to be gone

LineCallback = Callable[["Child", bytes], None]

# The guard: reads "+PGID" / "-PGID" lines from the owner; at end of file (the owner is
# gone, or closed its end) it stops every group still listed. Plain Python, no imports of
# expframe, in a session of its own so that no signal meant for the owner's group reaches it.
_GUARD = r"""
import os, signal, sys, time
grace = float(sys.argv[1])
groups = set()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
stream = os.fdopen(0, "rb", buffering=0)
buffer = b""
while True:
    try:
        data = stream.read(4096)
    except OSError:
        data = b""
    if not data:
        break
    buffer += data
    *lines, buffer = buffer.split(b"\n")
    for line in lines:
        if line[:1] == b"+":
            groups.add(int(line[1:]))
        elif line[:1] == b"-":
            groups.discard(int(line[1:]))
def alive(pgid):  # a member that is not a zombie (killpg(pgid, 0) also finds zombies: as live_groups)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                return True
    return False
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pgid in list(groups):
        try:
            os.killpg(pgid, sig)
        except OSError:
            groups.discard(pgid)
    deadline = time.monotonic() + grace
    while groups and time.monotonic() < deadline:
        groups = {g for g in groups if alive(g)}
        time.sleep(0.05)
"""


def describe_status(returncode: int) -> str:
    """`exited with status N` or `died with signal SIGNAME`."""
    if returncode < 0:
        try:
            return f"died with signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died with signal {-returncode}"
    return f"exited with status {returncode}"


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie has ended)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def live_groups() -> Dict[int, List[int]]:
    """Each process group that has a live (not zombie) member -> those members' pids, from
    one read of /proc."""
    groups: Dict[int, List[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] not in ("Z", "X"):
                groups[int(stat[2])].append(int(entry))
    return dict(groups)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is alive (zombies excepted: they are dead)."""
    return pgid in live_groups()


def _stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class Child:
    """One child process of an `Owner`: its name, `popen`, reader thread and output tail.

    Its pid is also its process group id (the child leads a session of its own).
    """

    def __init__(self, owner: "Owner", name: str, popen: subprocess.Popen, on_line: Optional[LineCallback],
                 forward: bool):
        self.owner, self.name, self.popen = owner, name, popen
        self.pid = self.pgid = popen.pid
        self.forward = forward
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._on_line = on_line
        self.reader: Optional[threading.Thread] = None

    def _start_reader(self) -> None:
        if self.popen.stdout is None:
            return
        self.reader = threading.Thread(target=self._pump, name=f"output of {self.name}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        stream = self.popen.stdout
        while True:
            try:
                line = stream.readline()
            except (OSError, ValueError):
                return
            if not line:
                return
            self.tail.append(line.decode("utf-8", errors="replace").rstrip("\n"))
            callback = self._on_line
            if callback is None:
                continue
            try:
                callback(self, line)
            except Exception as error:  # pylint: disable=broad-except
                # Never stop draining: a child blocked on a full pipe would hang the run.
                self._on_line = None
                try:
                    print(f"expframe: the output handler of {self.name} failed ({type(error).__name__}: "
                          f"{error}); its further output is read and dropped", file=sys.stderr, flush=True)
                except Exception:  # pylint: disable=broad-except
                    pass

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.returncode

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.popen.wait(timeout)

    def signal(self, signum: int) -> None:
        """Sends `signum` to the child's whole process group (also after the child itself
        exited: what it started may still run)."""
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        """Whether any process of the child's group still runs."""
        return self.alive() or group_alive(self.pgid)

    def is_stopped(self) -> bool:
        """Whether the child is stopped (SIGSTOP, state T): it cannot act on SIGTERM."""
        stat = _stat(self.pid)
        return stat is not None and stat[0] in ("T", "t")

    def join_output(self, timeout: float = 2.0) -> None:
        if self.reader is not None:
            self.reader.join(timeout)


class Owner:
    """Starts, watches and stops child processes; see the module docstring.

    Args:
      name: how the owner names itself in its lines (e.g. `expframe.launch`).
      guard: start the guard process that stops the children if this process dies
        without cleaning up (SIGKILL). On by default.
    """

    def __init__(self, name: str = "expframe", guard: bool = True):
        self.name = name
        self.children: List[Child] = []
        self._lock = threading.Lock()
        self._use_guard = guard
        self._guard: Optional[subprocess.Popen] = None
        self._guard_fd: Optional[int] = None
        self._closed = False
        atexit.register(self.close)

    # -- starting ---------------------------------------------------------------------------

    def start(self, argv: Sequence[str], name: str, *, env: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, on_line: Optional[LineCallback] = None, capture: bool = True,
              pass_fds: Iterable[int] = (), forward: bool = True) -> Child:
        """Starts `argv` in a session of its own and returns its `Child`.

        Args:
          argv: the command.
          name: how lines and errors name it (`worker 1`, `actor 0`).
          env: its environment (default: this process's).
          cwd: its working directory.
          on_line: called from the reader thread with each line (bytes, with its newline)
            of the child's stdout and stderr together; an exception it raises is reported
            once and the output is drained from then on without it.
          capture: False leaves the child's stdout and stderr on this process's (no reader).
          pass_fds: file descriptors the child inherits.
          forward: whether `signal()` without a list of children reaches it.
        """
        if self._closed:
            raise RuntimeError(f"{self.name}: cannot start {name}: its owner is closed")
        out = subprocess.PIPE if capture else None
        popen = subprocess.Popen(  # pylint: disable=consider-using-with
            list(argv), env=None if env is None else dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT if capture else None, pass_fds=tuple(pass_fds), start_new_session=True)
        child = Child(self, name, popen, on_line, forward)
        with self._lock:
            self.children.append(child)
        self._tell_guard(f"+{child.pgid}")
        child._start_reader()  # pylint: disable=protected-access
        return child

    def _tell_guard(self, line: str) -> None:
        if not self._use_guard:
            return
        with self._lock:
            if self._guard is None:
                read_fd, write_fd = os.pipe()
                try:
                    self._guard = subprocess.Popen(  # pylint: disable=consider-using-with
                        [sys.executable, "-S", "-c", _GUARD, str(GUARD_GRACE_S)], stdin=read_fd,
                        stdout=subprocess.DEVNULL, start_new_session=True)
                finally:
                    os.close(read_fd)
                self._guard_fd = write_fd
            try:
                os.write(self._guard_fd, (line + "\n").encode())
            except OSError:
                pass

    # -- watching and stopping ----------------------------------------------------------------

    def live(self) -> List[Child]:
        return [c for c in self.children if c.alive()]

    def signal(self, signum: int, children: Optional[Iterable[Child]] = None) -> None:
        """Sends `signum` to the groups of `children` (default: every child started with
        `forward=True`)."""
        targets = list(children) if children is not None else [c for c in self.children if c.forward]
        for child in targets:
            child.signal(signum)

    def stop(self, children: Optional[Iterable[Child]] = None, signum: Optional[int] = SIGTERM,
             grace_s: float = 3.0) -> None:
        """Stops `children` (default: all): `signum` to each group (None: already sent; a
        stopped child gets SIGKILL at once), SIGKILL to every group still alive after
        `grace_s`, then waits for them and their output. Groups whose leader already
        exited are signalled too."""
        targets = list(self.children if children is None else children)
        for child in targets:
            if signum is not None:
                child.signal(signum)
            if child.is_stopped():
                child.signal(SIGKILL)
        def running_after(seconds: float) -> List[Child]:
            """Waits up to `seconds` for every target's group to end; returns those still
            running (one read of /proc for all of them each time)."""
            deadline = time.monotonic() + seconds
            while True:
                live = live_groups()
                left = [c for c in targets if c.alive() or c.pgid in live]
                if not left or time.monotonic() >= deadline:
                    return left
                time.sleep(0.02)

        for child in running_after(grace_s):
            child.signal(SIGKILL)
        for child in targets:
            child.popen.wait()
        # SIGKILL is not instant: a group's other members (a shell's `sleep`) could still be
        # dying when its leader was reaped (seen on a loaded machine). Wait until they are.
        running_after(KILL_WAIT_S)
        for child in targets:
            child.join_output()
            self._forget(child)

    def _forget(self, child: Child) -> None:
        with self._lock:
            if child in self.children:
                self.children.remove(child)
        if child.popen.stdout is not None and (child.reader is None or not child.reader.is_alive()):
            child.popen.stdout.close()
        self._tell_guard(f"-{child.pgid}")

    def reap(self, child: Child, timeout: Optional[float] = None) -> int:
        """Waits for `child`, ends whatever it left in its group, joins its output and
        forgets it; returns its exit status."""
        code = child.popen.wait(timeout)
        if group_alive(child.pgid):
            self.stop([child], SIGTERM, grace_s=GUARD_GRACE_S)
        else:
            child.join_output()
            self._forget(child)
        return code

    def close(self, grace_s: float = 3.0) -> None:
        """Stops every child (SIGTERM, grace, SIGKILL) and the guard. Also at exit."""
        if self._closed:
            return
        try:
            self.stop(grace_s=grace_s)
        finally:
            self._closed = True
            if self._guard_fd is not None:
                try:
                    os.close(self._guard_fd)
                except OSError:
                    pass
                self._guard_fd = None
            if self._guard is not None:
                try:
                    self._guard.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    self._guard.kill()
                self._guard = None

    def __enter__(self) -> "Owner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: Optional[Owner] = None
_default_lock = threading.Lock()


def owner() -> Owner:
    """This process's shared owner (render workers, actors): closed at exit."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:  # pylint: disable=protected-access
            _default = Owner("expframe")
        return _default


def run(argv: Sequence[str], name: str, *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
        timeout: Optional[float] = None, capture: bool = True, check: bool = False,
        on_line: Optional[LineCallback] = None) -> subprocess.CompletedProcess:
    """`subprocess.run` through this process's `owner()`: the child runs in a session of its
    own and, however this call ends (its timeout, Ctrl-C, SIGKILL of this process), its
    whole group ends with it.

    Args:
      argv, name, env, cwd: as `Owner.start`.
      timeout: seconds; past it the child's group is stopped and `subprocess.TimeoutExpired`
        raised (with the output so far).
      capture: collect stdout and stderr together as text (`.stdout`); False leaves them on
        this process's.
      check: raise `subprocess.CalledProcessError` for a non-zero status.
      on_line: also called with each line (bytes), e.g. to echo it.

    Returns:
      a `subprocess.CompletedProcess` (`stderr` is None: it is in `stdout`).
    """
    own = owner()
    lines: List[bytes] = []

    def collect(child: Child, line: bytes) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(child, line)

    child = own.start(argv, name, env=env, cwd=cwd, on_line=collect if capture else None, capture=capture)
    try:
        code = own.reap(child, timeout)
    except subprocess.TimeoutExpired:
        own.stop([child], SIGTERM, grace_s=GUARD_GRACE_S)
        raise subprocess.TimeoutExpired(list(argv), timeout or 0.0,
                                        output=b"".join(lines).decode("utf-8", errors="replace")) from None
    except BaseException:
        own.stop([child], SIGTERM, grace_s=GUARD_GRACE_S)
        raise
    out = b"".join(lines).decode("utf-8", errors="replace") if capture else None
    if check and code != 0:
        raise subprocess.CalledProcessError(code, list(argv), output=out)
    return subprocess.CompletedProcess(list(argv), code, stdout=out, stderr=None)


def descendants(pid: int) -> Dict[int, str]:
    """Every live descendant of `pid` (pid -> command line), read from /proc. For tests and
    checks that nothing was left behind (a child re-parented to 1 is no longer found this
    way: look for its group with `group_alive`)."""
    children: Dict[int, List[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] not in ("Z", "X"):
                children[int(stat[1])].append(int(entry))
    out, todo = {}, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                out[p] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        todo.extend(children.get(p, []))
    return out
