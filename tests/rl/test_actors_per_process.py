"""Several actors in one process (`D4PGTask.actors_per_process`): acting together
(`run_together`: one batched policy call, environments stepped at once) writes what each
actor's own `run` writes, for state features and for rendered pixels; `ActorPool` starts 3
actors in 2 real processes (2 + 1), each actor sends the stream its own (seed, id,
restart, resume step) gives, and a killed process restarts as one with its actors' next
streams."""

import os
import signal

import gin
import keras
import numpy as np
import pytest

from expframe import processes
from expframe.models.d4pg import d4pg_policy
from expframe.rl.actor_pool import ActorPool
from expframe.rl.actors import PolicyExecutor, SynchronousActor, run_together
from expframe.rl.adders import NStepAdder
from expframe.rl.environments import control_suite
from expframe.rl.experience import TransitionBuffer, actor_buffer
from tests.rl.test_actor_seeding import ROWS, SHAPES, _expected_rows, policy_weights_and_config


def _actors(make_environment, executor, count, steps_adder):
    """`count` actors sharing `executor`, actor i in `make_environment(i)` with noise seed 10 + i."""
    out = []
    for i in range(count):
        environment = make_environment(i)
        buffer, adder = steps_adder(environment)
        out.append((SynchronousActor(environment, executor, adder, sigma=0.3 + 0.1 * i, seed=10 + i), buffer))
    return out


def _assert_same_streams(together, alone, tolerance):
    for (_, got), (_, expected) in zip(together, alone, strict=True):
        got, expected = got.drain(), expected.drain()
        assert got.keys() == expected.keys() and len(got["reward"]) > 0
        for key in got:
            np.testing.assert_allclose(got[key], expected[key], rtol=tolerance, atol=tolerance, err_msg=key)


def test_actors_acting_together_write_what_each_writes_alone():
    keras.utils.set_random_seed(0)
    policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(16,))
    rng = np.random.default_rng(1)
    weights = [rng.normal(0, 0.5, w.shape).astype(np.float32) for w in policy.get_weights()]
    transitions = lambda env: (lambda b: (b, NStepAdder(b, 3, 0.99)))(TransitionBuffer())  # noqa: E731
    make = lambda i: control_suite(name="cartpole/balance", seed=100 + i)  # noqa: E731
    executor = PolicyExecutor(policy, 5)
    executor.update(weights)
    together = _actors(make, executor, 3, transitions)
    run_together([a for a, _ in together], 1010)   # past an episode end (1,000 steps) and into the next
    alone = _actors(make, executor, 3, transitions)
    for actor, _ in alone:
        actor.run(1010)
    _assert_same_streams(together, alone, 0.0)   # a numpy policy: the same bits
    assert [a.episodes for a, _ in together] == [1, 1, 1] and together[0][0].env_steps == 1010
    # Three streams, not one three times: other episodes and other noise.
    assert not np.allclose(together[0][0].observe(), together[1][0].observe())
    other = SynchronousActor(make(0), PolicyExecutor(policy, 5), NStepAdder(TransitionBuffer(), 3, 0.99), 0.1, 0)
    with pytest.raises(ValueError, match="share one PolicyExecutor"):
        run_together([together[0][0], other], 1)


def _pixel_policy(shape, action_size):
    """A small convolutional policy on uint8 frame stacks (it runs through TensorFlow)."""
    inputs = keras.Input(shape, dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Conv2D(4, 3, strides=2, activation="relu")(x)
    x = keras.layers.Dense(action_size, activation="tanh")(keras.layers.Flatten()(x))
    return keras.Model(inputs, x)


def test_pixel_actors_acting_together_render_at_once_and_write_what_each_writes_alone():
    """2 pixel environments, each with its render worker, stepped with `step_async` /
    `step_wait`, through a convolutional policy called on a batch of 2 observations."""
    from expframe.rl.pixels import PixelControlSuiteEnvironment  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    environments = []
    try:
        for seed in (0, 1, 0, 1):
            environments.append(PixelControlSuiteEnvironment("cartpole/swingup", action_repeat=8, seed=seed, size=16,
                                                             frame_stack=2))
        executor = PolicyExecutor(_pixel_policy(environments[0].observation_shape, 1),
                                  environments[0].observation_shape)
        assert not executor.uses_numpy
        steps = lambda env: actor_buffer(env, 3, 0.99)  # noqa: E731
        together = _actors(lambda i: environments[i], executor, 2, steps)
        run_together([a for a, _ in together], 30)   # episodes of 125 steps: 30 inside the first
        alone = _actors(lambda i: environments[2 + i], executor, 2, steps)
        for actor, _ in alone:
            actor.run(30)
        _assert_same_streams(together, alone, 1e-5)   # a batched convolution rounds (~1e-7 in an action)
    finally:
        for environment in environments:
            environment.close()


def _first_rows_by_actor(pool, ids, timeout=180.0):
    """The first ROWS transitions each of `ids` sends from now on."""
    rows = {i: [] for i in ids}
    while any(sum(len(r["reward"]) for r in rows[i]) < ROWS for i in ids):
        assert pool.service.wait_for(1, timeout=timeout), {i: len(r) for i, r in rows.items()}
        for actor_id, arrays in pool.service.take_inserts():
            if actor_id in rows:
                rows[actor_id].append(arrays)
    return {i: {k: np.concatenate([r[k] for r in rows[i]])[:ROWS] for k in rows[i][0]} for i in ids}


def test_a_pool_of_three_actors_in_two_processes_sends_each_actors_own_stream(capsys):
    weights = policy_weights_and_config()
    pool = None
    try:
        pool = ActorPool(weights, SHAPES, num_actors=3, sigmas=[0.5] * 3, seed=3, weights_every=25, capacity=400,
                         max_restarts=1, actors_per_process=2)
        assert pool.groups == [[0, 1], [2]] and len(pool.processes) == 2 and pool.alive == 3
        assert "--actor_id=0,1" in pool.command(0) and "--sigma=0.5,0.5" in pool.command(0)
        first = _first_rows_by_actor(pool, [0, 1, 2])
        pool.check()
        assert sorted(pool.startup_s) == [0, 1, 2]
        err = capsys.readouterr().err
        pid = pool.processes[0].pid
        assert f"actor 0 (pid {pid}) ready after" in err and f"actor 1 (pid {pid}) ready after" in err
        # The process of actors 0 and 1 is killed: it restarts as one (one restart), both
        # actors with their restart-1 streams; actor 2's process goes on.
        process = pool.processes[0]
        process.signal(signal.SIGKILL)
        process.wait()
        pool.check()
        assert pool.restarts == 1 and pool.restart_counts == {0: 1, 1: 0} and pool.alive == 3
        assert "D4PGTask: actors 0-1 (pid" in capsys.readouterr().err
        pool.service.take_inserts()
        again = _first_rows_by_actor(pool, [0, 1])
        restarted = pool.processes[0]
    finally:
        if pool is not None:
            pool.close()
        gin.clear_config()
    assert not any(processes.group_alive(p.pid) for p in (process, restarted))
    for rows, restart in ((first, 0), (again, 1)):
        for actor_id, got in rows.items():
            expected = _expected_rows(weights, 3, actor_id, restart, 0)
            for key in got:
                np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-5,
                                           err_msg=f"actor {actor_id} restart {restart} {key}")
    assert not np.allclose(first[0]["action"], first[1]["action"])
    assert os.path.basename(pool.config_path) == "config.gin"


def test_an_actor_process_needs_one_sigma_per_distinct_actor_id(capsys):
    from expframe.rl import actor_process  # pylint: disable=import-outside-toplevel
    common = ["--address=127.0.0.1:1", "--seed=0", "--gin_config=none.gin"]
    for ids, sigmas, says in (("0,1", "0.3", "one sigma per id"), ("2,2", "0.1,0.2", "distinct ids"),
                              ("0,x", "0.1,0.2", "'0,x': give one int or several separated by commas")):
        with pytest.raises(SystemExit) as exit_:
            actor_process.main(common + [f"--actor_id={ids}", f"--sigma={sigmas}"])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
