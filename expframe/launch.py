"""`python -m expframe.launch`: a local multi-process TensorFlow cluster on 127.0.0.1.

    python -m expframe.launch --workers=2 -- main.py --gin_file=experiments/quickstart.gin \
        --gin_param="Replicator.target='multi_worker'"
    python -m expframe.launch --workers=2 --ps=1 -- main.py --gin_file=... \
        --gin_param="Replicator.target='parameter_server'"
    python -m expframe.launch --workers=4 --max_restarts=3 --min_workers=2 -- main.py ...
    python -m expframe.launch --workers=2 --ps=1 --evaluator -- main.py ... --mode=train
    python -m expframe.launch --emit=slurm --workers=4 -- main.py ... > run.sbatch

Everything after `--` is the command each program process runs (a first word ending
in `.py` runs with this Python). Free ports are taken on `--host` (127.0.0.1 unless
given), and every process gets a `TF_CONFIG` naming the cluster and its own task:

* `--ps=0` (MultiWorkerMirroredStrategy): every worker runs the program.
* `--ps=M` (ParameterServerStrategy): a `chief` task runs the program (the
  coordinator); the workers and parameter servers run plain TensorFlow servers,
  started by this module's internal `--serve` mode.

Each process's output lines are prefixed with its role (`[worker 1] ...`). Every
process runs in a session of its own, started by one `expframe.processes.Owner`:
SIGINT and SIGTERM to the launcher (or its process group) are forwarded once to every
process group (a second signal: SIGKILL), and however the launcher ends, SIGKILL
included, every group it started, with whatever the workers started in it, is gone
within seconds. A signal that arrives while a failed cluster is being stopped cancels
the restart: the launcher exits 128 + signal. When any process fails (non-zero status or
killed by a signal) the others are stopped (SIGTERM, then SIGKILL after a grace; a
stopped, SIGSTOPped, process at once: it could not act on SIGTERM) and the launcher
exits with 2 if that process exited 2 (a configuration error), else 1, after one line
that names the process and how it ended.

Restarts (`--max_restarts=N`): a failure other than exit status 2 starts the cluster
again with the same command, on fresh ports, up to N times; the program resumes from
its last checkpoint. One line per restart names the process that failed, how, the
step the restarted cluster resumed from (main.py's `resuming from step N` line) and
the restarts left; after N restarts the launcher exits 1. A worker whose process
fails again before the restarted cluster resumed cannot be restarted (its machine
is gone): with `--min_workers=M` < `--workers` the cluster continues without it,
down to M workers (each restart, with or without a worker less, counts). The global
batch is unchanged, so each worker's share grows and the learning rate, which
follows the global batch, stays as it was; a global batch that does not divide by
the new worker count is refused by main.py (exit 2, one line).

Every process also gets `EXPFRAME_LAUNCH_SLOT` (its index in the first cluster: a
worker keeps its slot when others are dropped), `EXPFRAME_LAUNCH_RESTARTS` (the
restarts so far) and a `TMPDIR` of its start of the cluster, removed when it ends.

`--evaluator`: one more process, TensorFlow's `evaluator` task (TF_CONFIG: the same
cluster, which by TensorFlow's convention does not list the evaluator, and task
`{"type": "evaluator", "index": 0}`), runs the program command with
`--mode=continuous_eval` in place of any `--mode` given: it evaluates each checkpoint
of the model_dir as it appears, on its own machine's devices. Its lines are prefixed
`[evaluator]`; the same owner starts it, so signals reach it and it ends with the
launcher. It is a sidecar: the launcher's exit status is the cluster's; a failed
evaluator is named in one line and nothing else is stopped; restarts restart the
cluster only. Once the cluster finished (0), the launcher waits for the evaluator to
evaluate the final checkpoint and exit, up to `--evaluator_wait_s` (600 s), then stops
it with SIGTERM and says so. Give the program `--mode=train`, so that evaluation is
left to the evaluator.

When a multi_worker cluster ends, TensorFlow's coordination service may read a peer's
normal exit as a crash and print `... StartAbort UNAVAILABLE ... The tasks have
crashed ...`: the launcher holds such lines back and prints them only if the cluster
failed.

Fault detection between the processes themselves (a peer that died or hangs on a
real cluster, with no launcher watching) is the coordination service's heartbeat:
`expframe.replicator.cluster.configure_fault_detection()` sets its timeout from `EXPFRAME_HEARTBEAT_TIMEOUT_S`,
which this launcher exports (`--heartbeat_timeout_s`).

`--data_service_workers=K`: K more processes, each one shard of a tf.data service (a
dispatcher and its one worker, `[data service k]`), started before the cluster and kept
over its restarts; the programs get their addresses in `$EXPFRAME_DATA_SERVICE`, and
their train input is prepared there, in its own order (`Trainer.data_service`,
expframe/replicator/data_service.py). A shard that ends while the cluster runs ends the
run (exit 1, one line naming it); signals reach the shards like every other process.

`--emit=slurm` prints a Slurm batch script for the same run instead (one task per
worker, `--requeue`, `--signal=B:TERM@<grace>`; with `--evaluator`, one task more and
the evaluator as a job step of its own; with `--data_service_workers=K`, K tasks more
and the shards as a job step of their own; see expframe/slurm_requeue.py).
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import List, Optional, Sequence

# The package's __init__ is lazy and processes.py imports no TensorFlow: the launcher
# starts in a fraction of a second.
from expframe import processes

# The same names as in expframe/replicator/cluster.py (checked by tests/test_launch.py);
# repeated here so that the launcher starts without importing TensorFlow.
HEARTBEAT_ENV = "EXPFRAME_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
SLOT_ENV = "EXPFRAME_LAUNCH_SLOT"
RESTARTS_ENV = "EXPFRAME_LAUNCH_RESTARTS"
DATA_SERVICE_ENV = "EXPFRAME_DATA_SERVICE"  # expframe/replicator/data_service.py's SERVICE_ENV
_PROG = "expframe.launch"
EVALUATOR = "evaluator"           # TensorFlow's task type of a sidecar evaluator (--evaluator)
EVALUATOR_MODE = "continuous_eval"
DEFAULT_EVALUATOR_WAIT_S = 600.0  # how long a finished cluster waits for its evaluator

# What main.py's chief prints once it restored (experiment.py, data_position.py).
_RESUMED = re.compile(rb"^resuming from step (\d+) ")
_FRESH = re.compile(rb"^model_dir .*: target '")
_POSITION = re.compile(rb"^expframe: (data position (?:carried over|re-derived): [^;]*)")
# What a worker's coordination-service client may print while a finished cluster shuts
# down (a peer's exit read as a crash); held back, and printed only if the cluster failed.
_SHUTDOWN_ABORT = re.compile(rb"StartAbort|The tasks have crashed\. Check the task logs")


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


def evaluator_config(cluster: dict) -> dict:
    """The evaluator's TF_CONFIG: the cluster as its other tasks see it (by TensorFlow's
    convention the evaluator is not in the cluster spec) and task `evaluator` 0."""
    return {"cluster": {role: list(tasks) for role, tasks in cluster.items() if role != EVALUATOR},
            "task": {"type": EVALUATOR, "index": 0}}


def evaluator_command(command: Sequence[str]) -> List[str]:
    """The program command with `--mode=continuous_eval` in place of any `--mode` given
    (`--mode=X` or `--mode X`, one dash or two), before a `--` that ends its flags."""
    command = list(command)
    end = command.index("--", 1) if "--" in command[1:] else len(command)
    out, args = command[:1], iter(command[1:end])
    for arg in args:
        if arg in ("--mode", "-mode"):
            next(args, None)  # its value
        elif not arg.startswith(("--mode=", "-mode=")):
            out.append(arg)
    return out + [f"--mode={EVALUATOR_MODE}"] + command[end:]


class _Process:
    """One child of the cluster: its role, slot and `processes.Child`. Its output lines are
    printed with its name as prefix, after `on_line(process, line)` saw them (it returns
    False for a line to hold back)."""

    def __init__(self, owner: processes.Owner, role: str, index: int, slot: int, command: List[str], env: dict,
                 is_server: bool, is_first_program: bool = False, on_line=None, forward: bool = True):
        self.name = role if role in ("chief", EVALUATOR) else f"{role} {index}"
        self.slot, self.is_server, self.is_first_program = slot, is_server, is_first_program
        prefix = f"[{self.name}] ".encode()
        out = sys.stdout.buffer

        def echo(child, line: bytes) -> None:  # pylint: disable=unused-argument
            if on_line is not None and on_line(self, line) is False:
                return
            with _print_lock:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()

        # Registered with the owner before its output is read (a line printed at once is
        # never lost, and never kills the reader: processes.Child._pump).
        self.child = owner.start(command, self.name, env=env, on_line=echo, forward=forward)

    @property
    def pid(self) -> int:
        return self.child.pid

    def poll(self) -> Optional[int]:
        return self.child.poll()

    def is_stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, state T in /proc): it cannot act on SIGTERM."""
        return self.child.is_stopped()


_print_lock = threading.Lock()


def _say(line: str) -> None:
    with _print_lock:
        print(f"{_PROG}: {line}", file=sys.stderr, flush=True)


class _Attempt:
    """One start of the cluster: its processes, how it ended, and where it resumed."""

    def __init__(self, owner: processes.Owner, program: List[str], slots: List[int], ps: int, host: str,
                 base_env: dict, restarts: int):
        self.owner = owner
        self.started = time.monotonic()
        self.slots = slots
        self.resumed_step: Optional[int] = None  # set by the chief's output
        self.position: Optional[str] = None
        self.held: List[bytes] = []  # the coordination service's shutdown lines, see _on_line
        self.cluster = cluster = make_cluster(len(slots), ps, host)
        server = [sys.executable, "-m", "expframe.launch", "--serve"]
        # Each start gets its own TMPDIR, removed when it ends: a killed worker's private
        # files (e.g. a non-chief's checkpoint copies) do not pile up over restarts.
        self.tmpdir = tempfile.mkdtemp(prefix="expframe_launch_")
        base_env = dict(base_env, TMPDIR=self.tmpdir)
        # Program processes first in the list: their output names the run.
        if ps:
            layout = [("chief", 0, -1, False)] + [("worker", i, s, True) for i, s in enumerate(slots)]
            layout += [("ps", i, -1, True) for i in range(ps)]
        else:
            layout = [("worker", i, s, False) for i, s in enumerate(slots)]
        self.procs: List[_Process] = []
        for n, (role, index, slot, is_server) in enumerate(layout):
            env = dict(base_env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}),
                       **{SLOT_ENV: str(slot), RESTARTS_ENV: str(restarts)})
            self.procs.append(_Process(owner, role, index, slot, server if is_server else program, env, is_server,
                                       is_first_program=n == 0, on_line=None if is_server else self._on_line))

    def children(self) -> List[processes.Child]:
        return [p.child for p in self.procs]

    def stop(self, signum: Optional[int], grace_s: float) -> None:
        """Sends `signum` (unless None: already sent) to every process's group, SIGKILL to
        what is left after `grace_s` (to a stopped process at once), and waits for all
        of them and their output."""
        self.owner.stop(self.children(), signum, grace_s)

    def remove_tmpdir(self) -> None:
        """Removes this start's TMPDIR (after its processes ended)."""
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _on_line(self, proc: _Process, line: bytes) -> bool:
        """Reads where the chief resumed; returns False for a line to hold back."""
        if _SHUTDOWN_ABORT.search(line):
            self.held.append(f"[{proc.name}] ".encode() + line)
            return False
        if not proc.is_first_program or self.resumed_step is not None:
            return True
        m = _POSITION.match(line)
        if m:
            self.position = m.group(1).decode(errors="replace").strip()
        m = _RESUMED.match(line)
        if m:
            self.resumed_step = int(m.group(1))
        elif _FRESH.match(line):
            self.resumed_step = 0
        return True

    def print_held(self) -> None:
        """Prints the held-back shutdown lines (the cluster failed: they may say why)."""
        for line in self.held:
            with _print_lock:
                sys.stdout.buffer.write(line if line.endswith(b"\n") else line + b"\n")
                sys.stdout.buffer.flush()
        self.held = []

    def poll(self):
        """None while running; else ("ok", None, 0) or ("failed", process, status).

        Of processes found failed at once, a configuration error (2) comes first, then one
        killed by a signal, then any other status: a worker whose peer died fails soon
        after it (status 1), and the one to name is the peer."""
        failed = []
        for p in self.procs:
            code = p.poll()
            # A server (ps mode's workers and ps) must not end while the chief runs.
            if code is not None and (code != 0 or p.is_server):
                failed.append((code != 2, code >= 0, p, code))
        if failed:
            _, _, p, code = min(failed, key=lambda f: f[:2])
            return "failed", p, code
        programs = [p for p in self.procs if not p.is_server]
        if all(p.poll() == 0 for p in programs):
            return "ok", None, 0
        return None


class _Evaluator:
    """The sidecar evaluator (`--evaluator`): started with the first cluster and kept
    over restarts; its failure is said in one line and ends nothing else."""

    def __init__(self, owner: processes.Owner, command: Sequence[str], cluster: dict, base_env: dict):
        self.owner = owner
        self.tmpdir = tempfile.mkdtemp(prefix="expframe_launch_")
        env = dict(base_env, TMPDIR=self.tmpdir, TF_CONFIG=json.dumps(evaluator_config(cluster)),
                   **{SLOT_ENV: "-1", RESTARTS_ENV: "0"})
        self.proc = _Process(owner, EVALUATOR, 0, -1, program_command(evaluator_command(command)), env,
                             is_server=False)
        self.reported = False

    def check(self, after: str = "the training goes on without it") -> None:
        """Says once, in one line, that the evaluator ended with a non-zero status."""
        code = self.proc.poll()
        if code not in (None, 0) and not self.reported:
            self.reported = True
            _say(f"{EVALUATOR} (pid {self.proc.pid}) {processes.describe_status(code)}; {after}")

    def stop(self, signum: Optional[int], grace_s: float) -> None:
        """Sends `signum` (None: already sent) to it, SIGKILL after `grace_s`, and waits."""
        if self.proc.child in self.owner.children:
            self.owner.stop([self.proc.child], signum, grace_s)

    def finish(self, received: List[int], wait_s: float, grace_s: float) -> None:
        """After the training finished: waits up to `wait_s` for the evaluator (it exits
        once it evaluated the final checkpoint), then stops it with SIGTERM, saying so.
        A signal to the launcher (`received`, already forwarded) ends the wait."""
        deadline = time.monotonic() + wait_s
        while self.proc.poll() is None and not received and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            if received:
                _say(f"received {signal.Signals(received[0]).name} while the {EVALUATOR} (pid {self.proc.pid}) "
                     "evaluated the finished training's checkpoints; stopped it")
            else:
                _say(f"{EVALUATOR} (pid {self.proc.pid}) had not finished {wait_s:g} s after the training "
                     "(--evaluator_wait_s); stopped it with SIGTERM")
            self.stop(None if received else signal.SIGTERM, grace_s)
        elif self.proc.child in self.owner.children:
            self.owner.reap(self.proc.child)
        self.check(after="the training had finished")

    def remove_tmpdir(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class _DataService:
    """The tf.data service's shards (`--data_service_workers`), one process each, started
    before the first cluster, kept over restarts and stopped after the last: a signal to
    the launcher reaches them only once the workers are gone, since a worker finishing
    its step may still wait for that step's batch (CI once saw both workers of a stopped
    run killed without their checkpoint: their shards had ended first)."""

    READY_TIMEOUT_S = 120.0

    def __init__(self, owner: processes.Owner, count: int, host: str, base_env: dict):
        self.owner = owner
        self.tmpdir = tempfile.mkdtemp(prefix="expframe_data_service_")
        self.files = [os.path.join(self.tmpdir, f"shard_{k}") for k in range(count)]
        self.procs = [
            _Process(owner, "data service", k, -1,
                     [sys.executable, "-m", "expframe.launch", "--serve_data_shard", f"--shard_host={host}",
                      f"--address_file={path}"], dict(base_env), is_server=True, forward=False)
            for k, path in enumerate(self.files)]

    def wait_ready(self, received: List[int]) -> Optional[str]:
        """The shards' addresses, host:port,... once all of them serve; None if one ended,
        `READY_TIMEOUT_S` passed or a signal came (`failure()` says which)."""
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        while not received and time.monotonic() < deadline and self.failure() is None:
            if all(os.path.exists(f) for f in self.files):
                return ",".join(open(f, encoding="utf-8").read().strip() for f in self.files)
            time.sleep(0.05)
        return None

    def failure(self) -> Optional[str]:
        """A line naming the first shard that ended, or None while all run."""
        for p in self.procs:
            code = p.poll()
            if code is not None:
                return f"{p.name} (pid {p.pid}) {processes.describe_status(code)}"
        return None

    def stop(self, signum: Optional[int], grace_s: float) -> None:
        self.owner.stop([p.child for p in self.procs if p.child in self.owner.children], signum, grace_s)

    def remove_tmpdir(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class _Restart:
    """A restart, whose line waits for where the restarted cluster resumed."""

    def __init__(self, number: int, max_restarts: int, failure: str, change: str, seen_at: float):
        self.number, self.max_restarts, self.failure, self.change = number, max_restarts, failure, change
        self.failed_at = seen_at  # when the launcher saw the failure, before it stopped the others

    def line(self, attempt: _Attempt, ended: str = "") -> str:
        """`restart k/N: <who> <how>[; <worker change>]; resumed from step S[; data position], T s
        after the failure; L restart(s) left`; `ended` says how a cluster that never
        reported its resume ended."""
        if attempt.resumed_step is None:
            resumed = f"the restarted cluster {ended} without reporting where it resumed"
        else:
            position = f"; {attempt.position}" if attempt.position else ""
            resumed = (f"resumed from step {attempt.resumed_step}{position}, "
                       f"{time.monotonic() - self.failed_at:.2f} s after the failure")
        return (f"restart {self.number}/{self.max_restarts}: {self.failure}{self.change}; {resumed}; "
                f"{self.max_restarts - self.number} restart(s) left")


def launch(command: Sequence[str], workers: int, ps: int = 0, host: str = "127.0.0.1",
           heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S, grace_s: float = 3.0,
           max_restarts: int = 0, min_workers: Optional[int] = None, evaluator: bool = False,
           evaluator_wait_s: float = DEFAULT_EVALUATOR_WAIT_S, data_service_workers: int = 0) -> int:
    """Runs the cluster until it finishes, fails with a configuration error (2), fails
    once more than `max_restarts` allows (1), or is signalled (128 + signal).

    With `evaluator`, one more process runs the command with `--mode=continuous_eval`
    (task `evaluator`, `evaluator_config`) beside the cluster, over its restarts; a
    finished cluster waits up to `evaluator_wait_s` for it. Its own exit status is
    said in one line, never the launcher's. With `data_service_workers` K, K tf.data service
    shards run beside it (`_DataService`) and the programs read their train input there."""
    min_workers = workers if min_workers is None else min_workers
    program = program_command(command)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", **{HEARTBEAT_ENV: str(heartbeat_timeout_s)})
    owner = processes.Owner(_PROG)
    received: List[int] = []
    signalled = set()  # pids that got the first signal: main.py takes a second one as "stop now"

    def forward(signum: int) -> None:
        # Not to children started with forward=False, the data service's shards: a worker that
        # finishes its step after the signal may still wait for that step's batch.
        for child in list(owner.children):
            if child.forward and child.pid not in signalled:
                signalled.add(child.pid)
                child.signal(signum)

    def on_signal(signum, frame):  # pylint: disable=unused-argument
        if received:  # a second signal: no more grace.
            owner.signal(signal.SIGKILL)
        received.append(signum)
        forward(signum)

    def stopped_by_signal() -> int:
        if sidecar:
            sidecar.stop(None, max(grace_s, 10.0))  # the signal was forwarded to it too
        if service:  # only now: the workers are gone (forward() and a second signal spare the shards)
            service.stop(signal.SIGTERM, grace_s)
        _say(f"received {signal.Signals(received[0]).name}; stopped all processes")
        return 128 + received[0]

    slots, restarts, restart, last_failed_slot, attempt = list(range(workers)), 0, None, None, None
    sidecar: Optional[_Evaluator] = None
    service: Optional[_DataService] = None
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if data_service_workers:
            service = _DataService(owner, data_service_workers, host, base_env)
            addresses = service.wait_ready(received)
            if received:
                return stopped_by_signal()
            if addresses is None:
                why = service.failure() or f"did not serve within {_DataService.READY_TIMEOUT_S:g} s"
                _say(f"the tf.data service did not start: {why}; nothing else was started")
                return 1
            base_env[DATA_SERVICE_ENV] = addresses
            _say(f"tf.data service: {data_service_workers} shard(s) at {addresses}")
        while True:
            if received:  # a signal while the failed cluster was stopped: no restart.
                return stopped_by_signal()
            attempt = _Attempt(owner, program, slots, ps, host, base_env, restarts)
            if evaluator and sidecar is None:  # one evaluator, kept over restarts
                sidecar = _Evaluator(owner, command, attempt.cluster, base_env)
            outcome = None
            while outcome is None:
                if sidecar:
                    sidecar.check()
                failed_shard = service.failure() if service and not received else None
                if failed_shard:
                    attempt.stop(signal.SIGTERM, grace_s)
                    attempt.print_held()
                    if sidecar:
                        sidecar.stop(signal.SIGTERM, grace_s)
                    _say(f"{failed_shard} while the cluster ran; stopped the others (a shard's worker is its "
                         "only one: the run cannot go on without it; the same command resumes)")
                    return 1
                if received:
                    forward(received[0])  # processes started after the signal came
                    attempt.stop(None, grace_s=max(grace_s, 10.0))
                    return stopped_by_signal()
                if restart and attempt.resumed_step is not None:
                    _say(restart.line(attempt))
                    restart = None
                outcome = attempt.poll()
                if outcome is None:
                    time.sleep(0.05)
            kind, p, code = outcome
            seen_at = time.monotonic()
            if kind == "ok":
                owner.stop([q.child for q in attempt.procs if q.is_server], signal.SIGTERM, grace_s)
                for q in attempt.procs:  # what a program left in its group goes with it
                    if not q.is_server:
                        owner.reap(q.child)
                attempt.held = []  # a clean end: the coordination service's abort lines say nothing
                if restart:
                    _say(restart.line(attempt, "finished"))
                if sidecar:
                    sidecar.finish(received, evaluator_wait_s, grace_s)
                if service:
                    service.stop(signal.SIGTERM, grace_s)
                return 0
            # A stopped (SIGSTOPped) process is what failed: the others noticed its missing heartbeats.
            hung = [q for q in attempt.procs if q is not p and q.poll() is None and q.is_stopped()]
            attempt.stop(signal.SIGTERM, grace_s)
            attempt.print_held()
            attempt.remove_tmpdir()
            if restart:  # the restarted cluster failed before it reported its resume.
                _say(restart.line(attempt, "failed"))
            what = f"{p.name} (pid {p.pid}) {processes.describe_status(code)}"
            if hung:
                what = f"{hung[0].name} (pid {hung[0].pid}) hung (stopped) and {what}"
                p = hung[0]
            if code == 2 or restarts >= max_restarts:
                tail = "" if code == 2 or not max_restarts else f"; no restarts left (--max_restarts={max_restarts})"
                if sidecar:  # no cluster to evaluate any more
                    sidecar.stop(signal.SIGTERM, grace_s)
                _say(f"{what}; stopped the others{tail}")
                return 2 if code == 2 else 1
            change = ""
            if (p.slot >= 0 and p.slot == last_failed_slot and attempt.resumed_step is None
                    and len(slots) > min_workers):
                slots = [s for s in slots if s != p.slot]
                change = (f"; worker slot {p.slot} failed again before the cluster resumed, so it cannot be "
                          f"restarted: continuing on {len(slots)} of {workers} workers (--min_workers="
                          f"{min_workers}; the global batch is unchanged, each worker's share grows)")
            last_failed_slot = p.slot
            restarts += 1
            restart = _Restart(restarts, max_restarts, what, change, seen_at)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        # Never leave a process behind, whatever happened above: every group the owner
        # started (a worker's own children too) gets SIGTERM, then SIGKILL.
        owner.close(grace_s=1.0)
        if attempt:
            attempt.remove_tmpdir()
        if sidecar:
            sidecar.remove_tmpdir()
        if service:
            service.remove_tmpdir()


# -- server mode (ps-mode workers and parameter servers) ---------------------------------

class _OneLineParser(argparse.ArgumentParser):
    """Reports a usage error in one line, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parse(argv: Sequence[str]):
    argv = list(argv)
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = _OneLineParser(
        prog=f"python -m {_PROG}",
        usage=f"python -m {_PROG} --workers=N [--ps=M] [--max_restarts=R [--min_workers=K]] [--evaluator] "
              "[--data_service_workers=K] [--host=127.0.0.1] -- <program> [args]",
        description="Starts a local TensorFlow cluster (TF_CONFIG per process) and runs a program on it.")
    parser.add_argument("--workers", type=int, default=1, help="worker tasks (default 1)")
    parser.add_argument("--ps", type=int, default=0,
                        help="parameter servers; > 0 adds a chief that runs the program (default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address every task binds (default 127.0.0.1)")
    parser.add_argument("--heartbeat_timeout_s", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                        help=f"coordination-service heartbeat timeout, exported as ${HEARTBEAT_ENV}")
    parser.add_argument("--grace_s", type=float, default=3.0,
                        help="seconds between SIGTERM and SIGKILL when stopping processes")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="start the cluster again after this many failures (not exit status 2; default 0)")
    parser.add_argument("--min_workers", type=int, default=None,
                        help="continue without a worker that cannot be restarted, down to this many "
                             "(default --workers: never)")
    parser.add_argument("--evaluator", action="store_true",
                        help="one more process, task type 'evaluator' (not in the cluster spec), runs the program "
                             f"with --mode={EVALUATOR_MODE} beside the cluster: it evaluates each checkpoint as it "
                             "appears; restarts leave it running, and its failure ends nothing else")
    parser.add_argument("--evaluator_wait_s", type=float, default=DEFAULT_EVALUATOR_WAIT_S,
                        help="once the training finished, how long to wait for the evaluator to evaluate the "
                             f"final checkpoint before stopping it (SIGTERM; default {DEFAULT_EVALUATOR_WAIT_S:g})")
    parser.add_argument("--data_service_workers", type=int, default=0, metavar="K",
                        help="K tf.data service shards (a dispatcher and a worker each) beside the cluster, which "
                             "prepare the programs' train input in its own order (default 0: none)")
    parser.add_argument("--emit", choices=("slurm",),
                        help="print a Slurm batch script for this run (one task per worker) instead of running it")
    parser.add_argument("--slurm_option", action="append", default=[], metavar="OPT",
                        help="extra #SBATCH option for --emit=slurm, e.g. --slurm_option=--partition=gpu")
    parser.add_argument("--signal_grace_s", type=int, default=None,
                        help="--emit=slurm: seconds before the time limit when Slurm warns the run with "
                             "SIGTERM (it checkpoints, exits and is requeued; default 120)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve_data_shard", action="store_true",
                        help="run one tf.data service shard (a dispatcher and its worker, on a free port) until "
                             "signalled, for Trainer.data_service='host:port,...' (no program)")
    parser.add_argument("--shard_host", default=None,
                        help="--serve_data_shard: the host name the shard gives its clients (default this machine's)")
    parser.add_argument("--address_file", default=None,
                        help="--serve_data_shard: write the shard's host:port here once it serves")
    args = parser.parse_args(argv)
    if not (args.serve or args.serve_data_shard):
        if not command:
            parser.error("no program given: put it after `--`, e.g. `-- main.py --gin_file=F`")
        if args.workers < 1 or args.ps < 0:
            parser.error(f"--workers={args.workers} must be >= 1 and --ps={args.ps} >= 0")
        if args.max_restarts < 0:
            parser.error(f"--max_restarts={args.max_restarts} must be >= 0")
        if args.min_workers is not None:
            if not 1 <= args.min_workers <= args.workers:
                parser.error(f"--min_workers={args.min_workers} must be between 1 and --workers={args.workers}")
            if args.max_restarts < 1 and args.min_workers < args.workers:
                parser.error("--min_workers takes effect on a restart: give --max_restarts >= 1 too")
        if not args.evaluator_wait_s > 0:
            parser.error(f"--evaluator_wait_s={args.evaluator_wait_s:g} must be > 0")
        if args.emit and args.ps:
            parser.error("--emit=slurm runs multi_worker tasks (one per worker); --ps must be 0")
        if args.data_service_workers < 0:
            parser.error(f"--data_service_workers={args.data_service_workers} must be >= 0")
        if args.data_service_workers and args.ps:
            parser.error("--data_service_workers serves synchronous training (multi_worker, or one process); "
                         "the parameter_server target's per-worker input cannot be served in order: --ps must be 0")
    return args, command


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    if args.serve:
        from expframe.replicator.cluster import serve  # pylint: disable=import-outside-toplevel
        serve()
        return 0
    if args.serve_data_shard:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a signal ends a shard at once: it holds no state
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # not the servers' configs, line by line
        from expframe import tf_noise  # pylint: disable=import-outside-toplevel
        with tf_noise.quiet_start():
            from expframe.replicator import data_service  # pylint: disable=import-outside-toplevel
        data_service.serve_shard(0, args.shard_host or socket.gethostname(), args.address_file)
        return 0
    if args.emit == "slurm":
        from expframe import slurm_requeue  # pylint: disable=import-outside-toplevel
        grace = slurm_requeue.DEFAULT_GRACE_S if args.signal_grace_s is None else args.signal_grace_s
        sidecar = evaluator_command(command) if args.evaluator else None
        print(slurm_requeue.single_run_script(command, args.workers, args.slurm_option, grace,
                                              evaluator_command=sidecar, evaluator_wait_s=args.evaluator_wait_s,
                                              data_service_workers=args.data_service_workers),
              end="")
        return 0
    return launch(command, args.workers, args.ps, args.host, args.heartbeat_timeout_s, args.grace_s,
                  args.max_restarts, args.min_workers, args.evaluator, args.evaluator_wait_s,
                  args.data_service_workers)


if __name__ == "__main__":
    sys.exit(main())
