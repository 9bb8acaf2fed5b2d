"""The learner's side of distributed acting: an RPC service and K actor processes.

`ActorPool` starts `LearnerService` and `num_actors` actors in processes of
`python -m expframe.rl.actor_process` (one actor each, or `actors_per_process` acting
together), each actor with its own exploration sigma and its own seeds, all reading
the learner's gin config (written to a temporary file). An actor's
seeds come from (run seed, actor id, restart count, resume step)
(`expframe.rl.actors.actor_seeds`): a restarted actor, and every actor of a learner
that resumed from a checkpoint at step s > 0, acts with new episodes and noise instead
of repeating its first ones, while the same four numbers give the same streams. It watches them:
an actor that exits (crash, SIGKILL) is logged with its id and exit status and
restarted while the pool's restart budget lasts; when no actor is left, `check`
raises `RunError` (the run stops with exit 1).

Lifetime: the actors start through the process's `expframe.processes.owner()`, each in a
session of its own, so a signal to the learner's process group (a terminal's Ctrl-C)
reaches the learner only; actors ignore SIGINT themselves too. Once the learner is
stopping (`close`, or a SIGINT or SIGTERM reached it while the pool ran) no actor is
restarted. The processes are stopped when the pool closes (the service refuses them, they
exit; what is left after a grace gets SIGTERM, then SIGKILL) or at interpreter exit; each
actor also stops when the learner's service stops answering or its parent process dies,
and the owner's guard ends them if the learner is killed, so none outlives the learner.
"""

import atexit
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import numpy as np

from expframe import processes
from expframe.errors import RunError
from expframe.rl.actor_process import DEFAULT_ACTING
from expframe.rl.rpc import LearnerService

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


LAG_BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, None))


def lag_histogram(lags: Dict[int, int]) -> Dict[str, float]:
    """Transitions per weight-lag bucket (learner steps): weight_lag_0, _1, _2, _3to4, ...,
    _33plus, and their mean lag (weight_lag_mean)."""
    out = {}
    for low, high in LAG_BUCKETS:
        name = f"weight_lag_{low}" if low == high else (f"weight_lag_{low}plus" if high is None
                                                         else f"weight_lag_{low}to{high}")
        out[name] = float(sum(n for lag, n in lags.items() if lag >= low and (high is None or lag <= high)))
    total = sum(lags.values())
    if total:
        out["weight_lag_mean"] = sum(lag * n for lag, n in lags.items()) / total
    return out


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _log(message: str) -> None:
    print(f"D4PGTask: {message}", file=sys.stderr, flush=True)


class ActorPool:
    """K actor processes feeding a `LearnerService` (see module docstring).

    Args:
      weights: the policy's initial weights.
      shapes: one transition's field shapes.
      num_actors: actors to start.
      sigmas: exploration sigma of each actor.
      seed: the run's seed; actor i's seeds are `actor_seeds(seed, i, restart, resume_step)`.
      weights_every: environment steps between an actor's weight fetches.
      capacity: most transitions pending in the service.
      max_restarts: restarts allowed over the whole run, all actors together.
      address: the service's host:port (port 0: a free one).
      resume_step: the learner step this learner process started from (0 for a fresh
        run, the checkpoint's step after a resume).
      acting: `module:function` that builds an actor's environment and policy
        (`expframe.rl.actor_process.ActingParts`), given to each actor as `--acting`.
      weight_names: the names of `weights` (`expframe.rl.actors.weight_names`), which
        each actor checks against its own policy's before loading any.
      startup_timeout_s: the longest an actor may take from its start to its first call
        to the service (importing TensorFlow, starting its renderer); more is a RunError.
        `wait_for`'s own timeout counts from when the first actor was ready.
      actors_per_process: actors that share one process (the last process may hold
        fewer): they import TensorFlow once and act in lockstep
        (`expframe.rl.actor_process`). A process that exits takes its actors with it;
        it is restarted as one (one restart of the budget).
      lockstep: the actors act in lockstep with the learner (`expframe.rl.lockstep`):
        which weights each chunk acts with and which chunks the learner takes are fixed by
        counts, so the run repeats. A restarted actor continues from the state its
        predecessor sent with its last chunk; an actor given up (no restarts left) stops
        the run, since every round needs every actor.
      lockstep_state: a checkpoint's `Lockstep.snapshot()` (lockstep only): the actors
        continue from where the checkpointed run's were.

    Processes are numbered 0, 1, ... and hold actors `groups[p]` (process p holds actors
    p*K .. p*K + K - 1 for K actors per process; with 1, process p is actor p).
    """

    def __init__(self, weights: Sequence[np.ndarray], shapes: Dict[str, Tuple[int, ...]], num_actors: int,
                 sigmas: Sequence[float], seed: int, weights_every: int, capacity: int, max_restarts: int,
                 address: str = "127.0.0.1:0", resume_step: int = 0, acting: str = DEFAULT_ACTING,
                 weight_names: Optional[Sequence[str]] = None, startup_timeout_s: float = 600.0,
                 actors_per_process: int = 1, lockstep: bool = False, lockstep_state=None):
        self.lockstep = bool(lockstep)
        self.service = LearnerService(weights, shapes, capacity, address, names=weight_names, version=resume_step,
                                      lockstep=num_actors if lockstep else 0, lockstep_state=lockstep_state)
        self.sigmas, self.seed, self.weights_every = list(sigmas), int(seed), int(weights_every)
        self.max_restarts, self.restarts = int(max_restarts), 0
        self.resume_step, self.acting = int(resume_step), acting
        per = max(1, int(actors_per_process))
        self.groups: List[List[int]] = [list(range(i, min(i + per, num_actors))) for i in range(0, num_actors, per)]
        self.restart_counts: Dict[int, int] = {g: 0 for g in range(len(self.groups))}   # process -> its restarts
        self._dir = tempfile.TemporaryDirectory(prefix="expframe_actors_")
        self.config_path = os.path.join(self._dir.name, "config.gin")
        with open(self.config_path, "w", encoding="utf-8") as f:
            f.write(gin.config_str())
        self.processes: Dict[int, Optional[processes.Child]] = {}
        self.startup_timeout_s = float(startup_timeout_s)
        self.started_at: Dict[int, float] = {}    # process -> when its current run started (monotonic)
        self.startup_s: Dict[int, float] = {}     # actor id -> seconds its current process took to be ready
        self.stopping = False
        self._closed = False
        self._chained: Dict[int, Tuple[object, object]] = {}   # signal -> (our handler, the one before)
        self._watch_stop_signals()
        for group in range(len(self.groups)):
            self._start(group)
        atexit.register(self.close)

    def _watch_stop_signals(self) -> None:
        """Notes a SIGINT or SIGTERM to the learner (then calls the handler it had, e.g. the
        trainer's checkpoint-and-exit): from then on no actor is restarted."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if not callable(previous):
                continue   # the default action or ignored: the learner ends, or the signal does nothing

            def handler(number, frame, previous=previous):
                self.stopping = True
                return previous(number, frame)
            self._chained[signum] = (handler, previous)
            signal.signal(signum, handler)

    def _unwatch_stop_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, (handler, previous) in self._chained.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, previous)
        self._chained = {}

    def name(self, group: int) -> str:
        """'actor 3' (a process of one actor) or 'actors 8-15' (process `group`'s actors)."""
        ids = self.groups[group]
        return f"actor {ids[0]}" if len(ids) == 1 else f"actors {ids[0]}-{ids[-1]}"

    def command(self, group: int) -> List[str]:
        """The command line of process `group`'s next start (as run on this host)."""
        ids = self.groups[group]
        return [sys.executable, "-m", "expframe.rl.actor_process", f"--address={self.service.address}",
                f"--actor_id={','.join(str(i) for i in ids)}", f"--seed={self.seed}",
                f"--restart={self.restart_counts[group]}", f"--resume_step={self.resume_step}",
                f"--sigma={','.join(str(self.sigmas[i]) for i in ids)}",
                f"--weights_every={self.weights_every}", f"--gin_config={self.config_path}",
                f"--stats_file={os.path.join(self._dir.name, f'actor_{group}.json')}", f"--acting={self.acting}"]

    def _start(self, group: int) -> None:
        # Its own session; its output stays on the learner's stderr.
        self.started_at[group] = time.monotonic()
        for actor_id in self.groups[group]:
            self.startup_s.pop(actor_id, None)
        self.processes[group] = processes.owner().start(self.command(group), name=self.name(group),
                                                        capture=False, forward=False)

    def ready_at(self, actor_id: int) -> Optional[float]:
        """When actor `actor_id` in its current process first called the service (None: not yet)."""
        group = next(g for g, ids in enumerate(self.groups) if actor_id in ids)
        seen = self.service.first_seen.get(actor_id)
        return seen if seen is not None and seen >= self.started_at[group] else None

    def _check_startup(self) -> None:
        """Logs each actor's start-up time once it is ready; RunError for one that is not
        ready `startup_timeout_s` after it started."""
        now = time.monotonic()
        for group, process in self.processes.items():
            if process is None:
                continue
            for actor_id in self.groups[group]:
                if actor_id in self.startup_s:
                    continue
                ready = self.ready_at(actor_id)
                if ready is not None:
                    self.startup_s[actor_id] = ready - self.started_at[group]
                    _log(f"actor {actor_id} (pid {process.pid}) ready after {self.startup_s[actor_id]:.1f} s "
                         "of start-up")
                elif now - self.started_at[group] > self.startup_timeout_s and process.alive():
                    self.close()
                    raise RunError(f"D4PGTask: actor {actor_id} (pid {process.pid}) did not call the learner "
                                   f"{now - self.started_at[group]:.0f} s after it started "
                                   f"(D4PGTask.actor_startup_timeout_s={self.startup_timeout_s:g}); its lines "
                                   "above say why (TensorFlow or a renderer that does not start); stopping.")


    @property
    def alive(self) -> int:
        """Actors whose process runs (or is being restarted)."""
        return sum(len(self.groups[g]) for g, p in self.processes.items() if p is not None)

    def check(self) -> None:
        """Logs and restarts (within the budget) exited actors; RunError when none is left.
        Once the learner is stopping, an exited actor is not restarted. Logs each actor's
        start-up time when it is ready; RunError for one not ready in `startup_timeout_s`."""
        for group, process in self.processes.items():
            if process is None or process.poll() is None:
                continue
            status, name = _status(process.returncode), self.name(group)
            processes.owner().reap(process)
            for actor_id in self.groups[group]:
                self.service.release(actor_id)   # its restart sends under the same id
            if self.stopping:
                _log(f"{name} (pid {process.pid}) {status}; not restarted: the learner is stopping")
                self.processes[group] = None
            elif self.restarts < self.max_restarts:
                self.restarts += 1
                self.restart_counts[group] += 1
                _log(f"{name} (pid {process.pid}) {status}; restarting it "
                     f"(restart {self.restarts} of {self.max_restarts})"
                     + ("; in lockstep it continues from the state sent with its last chunk" if self.lockstep else ""))
                self._start(group)
            elif self.lockstep:
                self.processes[group] = None
                self.close()
                raise RunError(f"D4PGTask: {name} (pid {process.pid}) {status} with no restarts left "
                               f"(D4PGTask.max_actor_restarts={self.max_restarts}); acting in lockstep "
                               "(run_experiment.deterministic = True), every round needs every actor: stopping.")
            else:
                _log(f"{name} (pid {process.pid}) {status}; no restarts left, "
                     f"going on with {self.alive - len(self.groups[group])} actor(s)")
                self.processes[group] = None
        if not self.alive:
            self.close()
            raise RunError(f"D4PGTask: all {len(self.processes)} actor processes have exited "
                           f"(restarts used: {self.restarts} of {self.max_restarts}); stopping.")
        self._check_startup()

    def wait_for(self, count: int, timeout_s: float) -> None:
        """Waits until `count` transitions are pending (in lockstep: until the first `count`
        rounds are complete), checking the actors every second.

        `timeout_s` counts from when an actor was ready (its first call), not from when the
        actors started: a slow start (8 actors importing TensorFlow on 2 cores) is not a
        failure; an actor that never becomes ready is (`startup_timeout_s`). Returns early
        once the learner has been signalled to stop (`stopping`)."""
        started = time.monotonic()
        wait = self.service.wait_for_rounds if self.lockstep else self.service.wait_for
        while not wait(count, timeout=1.0):
            if self.stopping:
                return   # the learner was signalled: it checkpoints instead of waiting on
            self.check()
            ready = [t for t in (self.ready_at(i) for g, p in self.processes.items() if p is not None
                                 for i in self.groups[g]) if t is not None]
            if not ready:
                continue   # still starting
            since = max(started, min(ready))
            if time.monotonic() - since > timeout_s:
                what = "rounds of chunks complete" if self.lockstep else "transitions"
                have = self.service.lockstep.complete() if self.lockstep else self.service.pending()
                raise RunError(f"D4PGTask: the actors sent {have} of {count} {what} "
                               f"in {timeout_s:.0f} s after they were ready; stopping.")

    def stats(self) -> Dict[int, dict]:
        """Timings the actor processes wrote at exit (process -> dict)."""
        import json  # pylint: disable=import-outside-toplevel
        out = {}
        for group in self.processes:
            path = os.path.join(self._dir.name, f"actor_{group}.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    out[group] = json.load(f)
        return out

    def close(self, timeout_s: float = 1.0) -> None:
        """Tells the actors to stop (the service refuses them) and waits up to `timeout_s`
        for them; then SIGTERM, and SIGKILL after a grace, to any still running (an actor
        holds nothing the learner needs: a chunk it is acting is dropped either way; its
        render worker stops at end of file, or by the actor's guard). No actor is
        restarted after this."""
        self.stopping = True
        if self._closed:
            return
        self._closed = True
        self._unwatch_stop_signals()
        self.service.close()
        running = [p for p in self.processes.values() if p is not None]
        deadline = time.monotonic() + timeout_s
        while any(p.alive() for p in running) and time.monotonic() < deadline:
            time.sleep(0.02)
        processes.owner().stop(running, signal.SIGTERM, grace_s=3.0)
