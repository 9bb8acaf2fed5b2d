"""ActorPool's deadlines: the wait for transitions counts from when an actor is ready (its
first call to the learner), so a slow start is not a failure; an actor that never becomes
ready is, with one line naming it. Actors here are stand-in processes (`sleep`) and an
in-process client speaks for actor 0: no TensorFlow subprocess."""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from expframe import processes
from expframe.errors import RunError
from expframe.rl.actor_pool import ActorPool
from expframe.rl.rpc import ActorClient

SHAPES = {"observation": (3,), "action": (1,), "reward": (), "discount": (), "next_observation": (3,)}


class _SleepingPool(ActorPool):
    """Actors that start and never call the learner (a process stuck importing, say)."""

    def command(self, actor_id):
        return [sys.executable, "-c", "import time; time.sleep(120)"]


def _pool(**kwargs):
    return _SleepingPool([np.ones(3, np.float32)], SHAPES, num_actors=1, sigmas=[0.1], seed=0, weights_every=5,
                         capacity=100, max_restarts=0, **kwargs)


def _steps(n):
    x = np.arange(n, dtype=np.float32)
    return {"observation": np.stack([x] * 3, 1), "action": x[:, None], "reward": x, "discount": np.ones(n, np.float32),
            "next_observation": np.stack([x] * 3, 1)}


def test_the_wait_counts_from_when_an_actor_is_ready(capsys):
    pool = _pool(startup_timeout_s=60.0)
    try:
        def slow_actor():   # ready 3 s after it started, sends 4 transitions 0.5 s later
            time.sleep(3.0)
            client = ActorClient(pool.service.address, 0, timeout_s=30)
            client.weights()
            time.sleep(0.5)
            client.insert(0, _steps(4), [])
        thread = threading.Thread(target=slow_actor)
        thread.start()
        started = time.monotonic()
        pool.wait_for(4, timeout_s=2.0)   # timed from the start (the old rule) it would fail at 2 s
        waited = time.monotonic() - started
        thread.join()
        assert waited >= 3.0 and pool.service.pending() == 4
        pool.check()   # as the learner does at every host call: logs the start-up time
        assert 3.0 <= pool.startup_s[0] < 60.0
        assert f"actor 0 (pid {pool.processes[0].pid}) ready after" in capsys.readouterr().err
    finally:
        pool.close()


def test_an_actor_that_never_becomes_ready_fails_with_one_line():
    pool = _pool(startup_timeout_s=2.0)
    pid = pool.processes[0].pid
    with pytest.raises(RunError, match=rf"^D4PGTask: actor 0 \(pid {pid}\) did not call the learner \d+ s after it "
                                       r"started \(D4PGTask.actor_startup_timeout_s=2\); its lines above say why"):
        pool.wait_for(4, timeout_s=1.0)
    assert pool.stopping and not processes.group_alive(pid)   # the pool closed: nothing left


def test_a_stop_signal_ends_the_wait_for_actors_still_starting():
    """SIGTERM to a learner waiting for actors that are still starting (32 on 2 cores take
    minutes): the wait ends within a second or so, for the trainer to checkpoint, instead of
    lasting until the actors send (or the 600 s start-up deadline)."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))  # the trainer's stand-in
    try:
        pool = _pool(startup_timeout_s=600.0)
        try:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            started = time.monotonic()
            pool.wait_for(4, timeout_s=600.0)
            waited = time.monotonic() - started
            assert pool.stopping and seen == [signal.SIGTERM]   # the learner's own handler still ran
            assert waited < 60.0, waited   # it returned on the signal, not on a deadline of 600 s
            assert pool.service.pending() == 0
        finally:
            pool.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
