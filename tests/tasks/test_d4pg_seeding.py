"""D4PG's random streams and episodes after a resume: the synchronous actor continues the
episode open at the checkpoint, in the same environment state, with the same noise, and
acts on exactly as the learner never stopped; a checkpoint of the acting state's first
format (no environment) still loads, starting a new episode; actor processes are seeded
with the step the learner resumed from. (Through main.py, with SIGTERM and SIGKILL:
tests/test_d4pg_resume.py.)"""

import contextlib
import functools
import io

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # disable_op_determinism is not public

import expframe as xf
import expframe.rl.actor_pool
from expframe.rl.environments import control_suite
from expframe.tasks.d4pg import ACTING_STATE_FORMAT
from tests.support import TestCase
from tests.tasks.test_d4pg import _Learner

# Episodes of 40 environment steps: several end within a few host calls.
SHORT_EPISODES = functools.partial(control_suite, name="cartpole/swingup", action_repeat=25)


class _Started(Exception):
    pass


class D4PGResumeSeedTest(TestCase):

    def _checkpointed(self, **overrides):
        """A learner after 3 host calls, mid-episode, and a checkpoint of it."""
        learner = _Learner(1, environment=SHORT_EPISODES, n_step=5, **overrides)
        for _ in range(3):
            learner.host_call(2)
        path = tf.train.Checkpoint(**learner.task.trackables()).write(self.get_temp_dir() + "/ckpt")
        return learner, path

    def test_a_resumed_learner_acts_and_learns_as_the_uninterrupted_one(self):
        tf.config.experimental.enable_op_determinism()   # as run_experiment.deterministic = True
        self.addCleanup(tf_config.disable_op_determinism)
        straight, path = self._checkpointed()
        actor = straight.task.actor
        self.assertIsNotNone(actor._observation)    # pylint: disable=protected-access  # an episode is open
        self.assertEqual(len(actor.adder._steps), 4)   # pylint: disable=protected-access  # n - 1 steps pending
        saved_step = straight.step
        for _ in range(10):
            straight.host_call(2)
        self.assertGreaterEqual(straight.task.actor.episodes, 3)   # episodes ended after the checkpoint
        resumed = _Learner(1, seed=5, environment=SHORT_EPISODES, n_step=5)   # other seeds: all comes from the file
        tf.train.Checkpoint(**resumed.task.trackables()).read(path).assert_consumed()
        resumed.step = saved_step
        for _ in range(10):
            metrics = resumed.host_call(2)
        expected, got = straight.task.acting_arrays(), resumed.task.acting_arrays()
        self.assertEqual(expected.keys(), got.keys())
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        for name, weights in straight.weights().items():
            for x, y in zip(weights, resumed.weights()[name], strict=True):
                np.testing.assert_array_equal(y, x, err_msg=name)
        # The weight-lag counts go on from the checkpoint's (in-process acting: all at lag 0).
        self.assertEqual(metrics["weight_lag_0"], resumed.task.actor.env_steps)

    def test_a_first_format_checkpoint_loads_and_starts_a_new_episode(self):
        learner, _ = self._checkpointed()
        arrays = learner.task.acting_arrays()
        kept = ("replay/", "actor/counters", "actor/rng")   # what format 1 held
        old = {k: v for k, v in arrays.items() if k.startswith(kept)}
        fresh = _Learner(1, environment=SHORT_EPISODES, n_step=5)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            fresh.task.restore_acting(old)
        self.assertIn("format 1 (no environment state)", printed.getvalue())
        self.assertEqual(len(printed.getvalue().strip().splitlines()), 1)
        self.assertIsNone(fresh.task.actor._observation)  # pylint: disable=protected-access
        self.assertEqual(fresh.task.actor.env_steps, learner.task.actor.env_steps)
        fresh.step = learner.step
        fresh.host_call(2)   # acts: a new episode
        self.assertEqual(fresh.task.actor.env_steps, learner.task.actor.env_steps + 2 * 32 // 8)
        newer = dict(arrays, format=np.array(ACTING_STATE_FORMAT + 1))
        with self.assertRaisesRegex(xf.ConfigError, f"format {ACTING_STATE_FORMAT + 1}, newer than"):
            fresh.task.restore_acting(newer)

    def test_actor_processes_of_a_resumed_learner_get_the_step_it_resumed_from(self):
        learner = _Learner(1, num_actors=1)
        started = {}

        def pool(*args, **kwargs):
            started.update(kwargs)
            raise _Started()

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(expframe.rl.actor_pool, "ActorPool", pool)
            with self.assertRaises(_Started):
                learner.task.before_train_steps(40, 2)
        self.assertEqual(started.get("resume_step"), 40)


def test_actor_runs_say_whether_they_repeat_and_deterministic_free_running_is_refused(capsys):
    from expframe.tasks.d4pg import _check_actor_reproducibility  # pylint: disable=import-outside-toplevel
    with pytest.raises(xf.ConfigError, match=r"^run_experiment.deterministic = True with D4PGTask.lockstep = False "):
        _check_actor_reproducibility(2, deterministic=True, lockstep=False, weights_every=100, n_step=5)
    with pytest.raises(xf.ConfigError, match=r"^D4PGTask.weights_every=4 is below D4PGTask.n_step=5: "):
        _check_actor_reproducibility(2, deterministic=True, lockstep=True, weights_every=4, n_step=5)
    capsys.readouterr()
    _check_actor_reproducibility(1, deterministic=False, lockstep=False, weights_every=100, n_step=5)
    assert capsys.readouterr().out == (
        "expframe: D4PG with 1 free-running actor process(es) is not bit-reproducible: acting follows the timing of "
        "the weight updates (run_experiment.deterministic = True runs the actors in lockstep with the learner, "
        "reproducibly).\n")
    _check_actor_reproducibility(2, deterministic=True, lockstep=True, weights_every=5, n_step=5)
    assert capsys.readouterr().out.startswith("expframe: D4PG's 2 actor process(es) act in lockstep with the learner")
