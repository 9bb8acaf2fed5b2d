"""`python -m expframe.launch`: a local multi-process TensorFlow cluster on 127.0.0.1.

    python -m expframe.launch --workers=2 -- main.py --gin_file=experiments/quickstart.gin \
        --gin_param="Replicator.target='multi_worker'"
    python -m expframe.launch --workers=2 --ps=1 -- main.py --gin_file=... \
        --gin_param="Replicator.target='parameter_server'"

Everything after `--` is the command each program process runs (a first word ending
in `.py` runs with this Python). Free ports are taken on `--host` (127.0.0.1 unless
given), and every process gets a `TF_CONFIG` naming the cluster and its own task:

* `--ps=0` (MultiWorkerMirroredStrategy): every worker runs the program.
* `--ps=M` (ParameterServerStrategy): a `chief` task runs the program (the
  coordinator); the workers and parameter servers run plain TensorFlow servers,
  started by this module's internal `--serve` mode.

Each process's output lines are prefixed with its role (`[worker 1] ...`). SIGINT and
SIGTERM are forwarded to every process. When any process fails (non-zero status or
killed by a signal) the others are stopped (SIGTERM, then SIGKILL after a grace) and
the launcher exits with 2 if that process exited 2 (a configuration error), else 1,
after one line that names the process and how it ended.

Fault detection between the processes themselves (a peer that died or hangs on a
real cluster, with no launcher watching) is the coordination service's heartbeat:
`expframe.replicator.cluster.configure_fault_detection()` sets its timeout from `EXPFRAME_HEARTBEAT_TIMEOUT_S`,
which this launcher exports (`--heartbeat_timeout_s`).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

# The same names as in expframe/replicator/cluster.py (checked by tests/test_launch.py);
# repeated here so that the launcher starts without importing TensorFlow.
HEARTBEAT_ENV = "EXPFRAME_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
_PROG = "expframe.launch"


# -- cluster -----------------------------------------------------------------------------

def free_ports(host: str, count: int) -> List[int]:
    """`count` distinct free TCP ports on `host` (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_cluster(workers: int, ps: int, host: str) -> dict:
    """The cluster dict: workers (+ a chief and ps tasks when ps > 0) on free ports."""
    roles = [("chief", 1)] if ps else []
    roles += [("worker", workers)] + ([("ps", ps)] if ps else [])
    ports = iter(free_ports(host, sum(n for _, n in roles)))
    fmt = "[{}]:{}" if ":" in host else "{}:{}"
    return {role: [fmt.format(host, next(ports)) for _ in range(n)] for role, n in roles}


def program_command(args: Sequence[str]) -> List[str]:
    """The command to run: `x.py ...` runs with this Python, anything else as given."""
    args = list(args)
    if args and args[0].endswith(".py"):
        return [sys.executable] + args
    return args


class _Process:
    """One child: its role, its Popen, and the thread that prefixes its output."""

    def __init__(self, role: str, index: int, command: List[str], env: dict, is_server: bool):
        self.name = "chief" if role == "chief" else f"{role} {index}"
        self.is_server = is_server
        self.popen = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)  # own group: we forward signals.
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self):
        prefix = f"[{self.name}] ".encode()
        out = sys.stdout.buffer
        for line in iter(self.popen.stdout.readline, b""):
            with _print_lock:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


_print_lock = threading.Lock()


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died with signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died with signal {-returncode}"
    return f"exited with status {returncode}"


def _stop(procs: Sequence[_Process], signum: Optional[int], grace_s: float) -> None:
    """Sends `signum` (unless None: already sent) to every live process, then SIGKILL
    to those still alive after `grace_s`, and waits for all of them and their output."""
    for p in procs:
        if signum is not None and p.popen.poll() is None:
            p.signal(signum)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in procs):
        time.sleep(0.02)
    for p in procs:
        if p.popen.poll() is None:
            p.signal(signal.SIGKILL)
    for p in procs:
        p.popen.wait()
        p.reader.join(timeout=2.0)


def launch(command: Sequence[str], workers: int, ps: int = 0, host: str = "127.0.0.1",
           heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S, grace_s: float = 3.0) -> int:
    """Runs the cluster until it finishes or fails; returns the launcher's exit status."""
    cluster = make_cluster(workers, ps, host)
    program = program_command(command)
    server = [sys.executable, "-m", "expframe.launch", "--serve"]
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", **{HEARTBEAT_ENV: str(heartbeat_timeout_s)})
    procs: List[_Process] = []
    # Program processes first in the list: their output names the run.
    layout = [("chief", 0, False)] if ps else [("worker", i, False) for i in range(workers)]
    if ps:
        layout += [("worker", i, True) for i in range(workers)] + [("ps", i, True) for i in range(ps)]
    received = []

    def on_signal(signum, frame):  # pylint: disable=unused-argument
        if received:  # a second signal: no more grace.
            for p in procs:
                p.signal(signal.SIGKILL)
        received.append(signum)
        for p in procs:
            p.signal(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for role, index, is_server in layout:
            env = dict(base_env, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": role, "index": index}}))
            procs.append(_Process(role, index, server if is_server else program, env, is_server))
        while True:
            if received:
                _stop(procs, None, grace_s=max(grace_s, 10.0))  # on_signal forwarded it.
                name = signal.Signals(received[0]).name
                print(f"{_PROG}: received {name}; stopped all processes", file=sys.stderr, flush=True)
                return 128 + received[0]
            failed = None
            for p in procs:
                code = p.popen.poll()
                if code is None:
                    continue
                # A server (ps mode's workers and ps) must not end while the chief runs.
                if code != 0 or p.is_server:
                    failed = (p, code)
                    break
            if failed:
                p, code = failed
                _stop(procs, signal.SIGTERM, grace_s)
                print(f"{_PROG}: {p.name} (pid {p.popen.pid}) {_describe(code)}; stopped the others",
                      file=sys.stderr, flush=True)
                return 2 if code == 2 else 1
            programs = [p for p in procs if not p.is_server]
            if all(p.popen.poll() == 0 for p in programs):
                _stop([p for p in procs if p.is_server], signal.SIGTERM, grace_s)
                for p in programs:
                    p.reader.join(timeout=2.0)
                return 0
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # never leave orphans, whatever happened above.
            if p.popen.poll() is None:
                p.signal(signal.SIGKILL)


# -- server mode (ps-mode workers and parameter servers) ---------------------------------

def _parse(argv: Sequence[str]):
    argv = list(argv)
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        prog=f"python -m {_PROG}",
        usage=f"python -m {_PROG} --workers=N [--ps=M] [--host=127.0.0.1] -- <program> [args]",
        description="Starts a local TensorFlow cluster (TF_CONFIG per process) and runs a program on it.")
    parser.add_argument("--workers", type=int, default=1, help="worker tasks (default 1)")
    parser.add_argument("--ps", type=int, default=0,
                        help="parameter servers; > 0 adds a chief that runs the program (default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address every task binds (default 127.0.0.1)")
    parser.add_argument("--heartbeat_timeout_s", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                        help=f"coordination-service heartbeat timeout, exported as ${HEARTBEAT_ENV}")
    parser.add_argument("--grace_s", type=float, default=3.0,
                        help="seconds between SIGTERM and SIGKILL when stopping processes")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.serve:
        if not command:
            parser.error("no program given: put it after `--`, e.g. `-- main.py --gin_file=F`")
        if args.workers < 1 or args.ps < 0:
            parser.error(f"--workers={args.workers} must be >= 1 and --ps={args.ps} >= 0")
    return args, command


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    if args.serve:
        from expframe.replicator.cluster import serve  # pylint: disable=import-outside-toplevel
        serve()
        return 0
    return launch(command, args.workers, args.ps, args.host, args.heartbeat_timeout_s, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
