"""D4PG's random streams after a resume: the synchronous actor neither restarts its
environment stream nor its noise (the same checkpoint and step give the same stream
again), and actor processes are seeded with the step the learner resumed from."""

import numpy as np
import pytest
import tensorflow as tf

import expframe.rl.actor_pool
from tests.support import TestCase
from tests.tasks.test_d4pg import _Learner


class _Started(Exception):
    pass


class D4PGResumeSeedTest(TestCase):

    def _resumed(self, path, step):
        """A fresh learner restored from `path` that acts for the host call at `step`."""
        learner = _Learner(1)
        tf.train.Checkpoint(**learner.task.trackables()).read(path).assert_consumed()
        restored_rng = learner.task.actor.state()["rng"]
        learner.task.before_train_steps(step, 1)   # acting only: the steps need not run
        return learner.task, restored_rng

    def test_synchronous_actor_after_resume_acts_with_new_episodes_and_continued_noise(self):
        first = _Learner(1)
        first.task.before_train_steps(0, 2)        # 200 + 2 * 32 / 8 environment steps
        task = first.task
        self.assertEqual((task.actor.env_steps, task.actor.episodes), (208, 0))   # episode 0 in progress
        path = tf.train.Checkpoint(**task.trackables()).write(self.get_temp_dir() + "/ckpt")
        saved = task.replay.inserted
        resumed, rng = self._resumed(path, 2)
        again, _ = self._resumed(path, 2)
        # The noise generator continues from the checkpoint (it does not restart).
        self.assertEqual(str(rng), str(task.actor.state()["rng"]))
        rows = {k: v for k, v in resumed.replay.state().items() if k.startswith("data/")}
        self.assertGreater(resumed.replay.inserted, saved)
        # The first episode after the resume is a new one: its first observation is not
        # the run's first episode's (the environment stream does not restart).
        self.assertFalse(np.array_equal(rows["data/observation"][saved], rows["data/observation"][0]))
        # The same checkpoint resumed at the same step acts the same.
        for key, value in again.replay.state().items():
            if key.startswith("data/"):
                np.testing.assert_array_equal(value[:again.replay.inserted], rows[key][:resumed.replay.inserted],
                                              err_msg=key)

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
