"""Actor seeds: a restarted actor process and the actors of a resumed learner act with new
random streams (episodes and noise); the same (seed, actor id, restart, resume step) acts
with the same stream again. Real actor processes started by `ActorPool` (a resumed
learner's pool, then a restart), fixed weights, against the streams rebuilt in-process."""

import os
import signal
import time

import gin
import keras
import numpy as np
import pytest

from expframe import config, processes
from expframe.errors import RunError
from expframe.models.d4pg import d4pg_policy
from expframe.rl.actor_pool import ActorPool
from expframe.rl.actors import PolicyExecutor, SynchronousActor, actor_seeds
from expframe.rl.adders import NStepAdder
from expframe.rl.environments import control_suite
from expframe.rl.experience import TransitionBuffer

SHAPES = {"observation": (5,), "action": (1,), "reward": (), "discount": (), "next_observation": (5,)}
GIN = """
D4PGTask.environment = @control_suite
control_suite.name = 'cartpole/balance'
D4PGTask.policy_network = @d4pg_policy
d4pg_policy.layer_sizes = (16,)
D4PGTask.n_step = 3
"""
ROWS = 20   # compared transitions: the first of each stream (one chunk of weights_every = 25 steps)


def _first_rows(pool, timeout=120.0):
    """The first ROWS transitions the pool's (single) actor sends from now on."""
    assert pool.service.wait_for(ROWS, timeout=timeout), "no transitions from the actor process"
    return {k: v[:ROWS] for k, v in pool.service.take().items()}


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


def test_actor_seeds_differ_in_every_number_even_when_zero():
    seeds = {(i, r, s): actor_seeds(7, i, r, s) for i in (0, 1) for r in (0, 1) for s in (0, 40)}
    assert len(set(seeds.values())) == len(seeds)
    assert actor_seeds(7, 1, 1, 40) == actor_seeds(7, 1, 1, 40)
    # The synchronous actor's first seeds (SeedSequence(seed)) are not actor 0's at step 0.
    assert tuple(int(x) for x in np.random.SeedSequence(7).generate_state(2)) != actor_seeds(7, 0, 0, 0)
    with pytest.raises(ValueError, match="restart=-1"):
        actor_seeds(7, 0, -1, 0)


def _expected_rows(weights, seed, actor_id, restart, resume_step):
    """What an actor seeded from `actor_seeds(...)` sends first (built as the actor process builds it)."""
    environment_seed, noise_seed = actor_seeds(seed, actor_id, restart, resume_step)
    environment = control_suite(name="cartpole/balance", seed=environment_seed)
    policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(16,))
    buffer = TransitionBuffer()
    actor = SynchronousActor(environment, PolicyExecutor(policy, 5), NStepAdder(buffer, 3, 0.99), sigma=0.5,
                             seed=noise_seed)
    actor.update(weights)
    actor.run(ROWS + 3)
    return {k: v[:ROWS] for k, v in buffer.drain().items()}


def policy_weights_and_config():
    """The fixed weights the actors act with; GIN parsed for the actor processes to read."""
    keras.utils.set_random_seed(0)
    weights = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(16,)).get_weights()
    config.register_symbols()
    gin.parse_config(GIN)
    return weights


def test_restarted_and_resumed_actors_act_with_new_streams_and_same_numbers_repeat():
    weights = policy_weights_and_config()
    pool = None
    try:
        # The pool of a learner resumed at step 40.
        pool = ActorPool(weights, SHAPES, num_actors=1, sigmas=[0.5], seed=3, weights_every=25, capacity=200,
                         max_restarts=1, resume_step=40)
        resumed = _first_rows(pool)
        # The actor leads a session of its own (a signal to the learner's group does not
        # reach it), and ignores SIGINT itself: it goes on sending.
        process = pool.processes[0]
        assert os.getsid(process.pid) == process.pid != os.getsid(0)
        process.signal(signal.SIGINT)
        pool.service.take()
        _first_rows(pool)
        assert process.alive()
        # Kill its actor: the pool restarts it (the actor's restart 1).
        process.signal(signal.SIGKILL)
        process.wait()
        pool.service.take()
        pool.check()
        assert pool.restart_counts[0] == 1 and "--restart=1" in pool.command(0)
        restarted = _first_rows(pool)
        # A SIGINT reaches the learner (here: pytest's KeyboardInterrupt, the handler the
        # pool found): the pool notes that the run is stopping, and restarts nothing more.
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass
        assert pool.stopping
        again = pool.processes[0]
        again.signal(signal.SIGKILL)
        again.wait()
        with pytest.raises(RunError, match="all 1 actor processes have exited"):
            pool.check()
        assert pool.restarts == 1 and pool.processes[0] is None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # closed: its handler is gone
        assert not any(processes.group_alive(p.pid) for p in (process, again))
    finally:
        if pool is not None:
            pool.close()
        gin.clear_config()
    # Each process acted exactly as its (seed, id, restart, resume step) says (the same
    # numbers give the same stream: rebuilt here in this process).
    for rows, numbers in ((resumed, (3, 0, 0, 40)), (restarted, (3, 0, 1, 40))):
        expected = _expected_rows(weights, *numbers)
        for key in rows:
            np.testing.assert_allclose(rows[key], expected[key], rtol=1e-6, atol=1e-6, err_msg=f"{numbers} {key}")
    # Neither repeats the stream of a fresh learner's actor 0, nor each other: new
    # episodes (first observations) and new noise (actions from the same weights).
    fresh = _expected_rows(weights, 3, 0, 0, 0)
    for a, b in ((fresh, resumed), (fresh, restarted), (resumed, restarted)):
        assert not np.array_equal(a["observation"][0], b["observation"][0])
        assert not np.allclose(a["action"], b["action"])
