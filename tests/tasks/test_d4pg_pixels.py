"""D4PG from pixels: the learner on 1 and 2 replicas gives the same weights (deterministic mode,
random shifts on), the observation network is the critic's to train, the acting policy carries
its weights, and the frame replay round-trips through a checkpoint."""

import functools

import gin
import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # disable_op_determinism is not public

import expframe as xf
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from expframe.models.pixel_encoder import drq_encoder
from expframe.rl import frame_strip
from expframe.rl.environments import control_suite
from expframe.rl.frame_replay import FrameReplay
from expframe.tasks.d4pg import D4PGTask
from tests.support import TestCase

BATCH = 8


def _task(**overrides):
    kwargs = dict(environment=functools.partial(control_suite, name="cartpole/swingup", action_repeat=8, pixels=True,
                                                size=16, frame_stack=2),
                  observation_network=functools.partial(drq_encoder, num_filters=4, num_layers=2, feature_size=8),
                  policy_network=functools.partial(d4pg_policy, layer_sizes=(16,)),
                  critic_network=functools.partial(d4pg_critic, layer_sizes=(16,), num_atoms=11, v_min=-20.0,
                                                   v_max=20.0),
                  actor_optimizer=lambda: keras.optimizers.SGD(0.05),
                  critic_optimizer=lambda: keras.optimizers.SGD(0.05),
                  n_step=3, min_replay_size=24, max_replay_size=500, target_update_period=2, samples_per_insert=8.0,
                  eval_episodes=1)
    kwargs.update(overrides)
    return D4PGTask(**kwargs)


class _Learner:
    """What the trainer does around a task: build in scope, distribute the input, host calls."""

    def __init__(self, num_replicas, seed=0, **overrides):
        keras.utils.set_random_seed(seed)
        self.rep = xf.Replicator("cpu", num_replicas)
        self.task = _task(**overrides)
        self.task.setup(self.rep, BATCH, seed=seed, deterministic=True)
        with self.rep.scope():
            self.task.build()
        self.iterator = iter(self.rep.distribute(self.task.train_input_fn, BATCH))
        self.step = 0

    def host_call(self, num_steps):
        self.task.before_train_steps(self.step, num_steps)
        out = self.rep.run_steps(self.task.train_step, self.iterator, num_steps)
        self.step += num_steps
        out.update(self.task.after_train_steps(self.step))
        return out

    def weights(self):
        names = ("observation_network", "target_observation_network", "policy", "critic", "target_policy",
                 "target_critic")
        return {name: [np.asarray(w) for w in getattr(self.task, name).get_weights()] for name in names}


def _max_change(before, after):
    return max(float(np.abs(a - b).max()) for a, b in zip(before, after, strict=True))


class D4PGPixelsTest(TestCase):

    def test_two_replicas_equal_one_in_deterministic_mode_and_a_checkpoint_round_trip(self):
        tf.config.experimental.enable_op_determinism()
        try:
            results, learners = {}, {}
            gin.bind_parameter("FrameReplay.random_shift", 2)   # DrQ's augmentation, drawn on the host
            for replicas in (1, 2):
                learner = learners[replicas] = _Learner(replicas)
                self.assertIsInstance(learner.task.replay, FrameReplay)
                self.assertEqual(learner.task.replay.random_shift, 2)
                initial = learner.weights()
                metrics = learner.host_call(3)   # one host call: both read the same 3 batches
                results[replicas] = (initial, learner.weights(), learner.task.replay.priorities(), metrics)
                if replicas == 2:
                    for variable in learner.task.observation_network.weights + learner.task.critic.weights:
                        self.assertSameValuePerReplica(learner.rep, variable.value)
        finally:
            tf_config.disable_op_determinism()
        (init1, after1, priorities1, metrics1), (init2, after2, priorities2, metrics2) = results[1], results[2]
        for name in after1:
            for a, b in zip(init1[name], init2[name], strict=True):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(after1[name], after2[name], strict=True):
                np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5, err_msg=name)
        # The encoder learned (from the critic) and its target copy moved at step 2.
        self.assertGreater(_max_change(init1["observation_network"], after1["observation_network"]), 1e-4)
        self.assertGreater(_max_change(init1["target_observation_network"], after1["target_observation_network"]),
                           1e-4)
        np.testing.assert_allclose(priorities1, priorities2, rtol=1e-4)
        self.assertAlmostEqual(metrics1["loss"], metrics2["loss"], places=5)
        self.assertEqual(metrics1["replay_size"], metrics2["replay_size"])

        # The critic's optimizer trains the encoder; the policy's has none of its variables (the
        # policy reads its features through stopped gradients), as Acme's D4PG.
        task = learners[1].task
        encoder_ids = {id(v) for v in task.observation_network.trainable_variables}
        self.assertFalse(encoder_ids & {id(v) for v in task.policy.trainable_variables})
        self.assertLessEqual(encoder_ids, {id(v) for v in task._critic_variables()})  # pylint: disable=protected-access
        # The acting policy (the actor's own encoder and policy) acts as the learner's networks do.
        acting = task.make_acting_policy(task.environment)
        acting.set_weights(task.acting_weights())
        observation = task.environment.reset()[None]
        np.testing.assert_allclose(acting(observation), task.policy(task.observation_network(observation)),
                                   atol=1e-6)
        task.actor.update(task.acting_weights())
        np.testing.assert_allclose(task.actor.policy(observation[0]), acting(observation)[0], atol=1e-6)

        # Checkpoint: write, go on (acting, learning), read back: networks and frame replay as written.
        checkpoint = tf.train.Checkpoint(**task.trackables())
        path = checkpoint.save(self.get_temp_dir() + "/checkpoints/ckpt")   # where the trainer writes them
        saved_weights, saved_replay = learners[1].weights(), task.replay.state()
        # frame_strip finds the frame replay in it (the PNG of frames the agent saw).
        for key, value in frame_strip.replay_arrays(self.get_temp_dir()).items():
            np.testing.assert_array_equal(value, saved_replay[key], err_msg=key)
        learners[1].host_call(2)
        self.assertGreater(task.replay.frames_written, len(saved_replay["ids"]))
        checkpoint.read(path).assert_consumed()
        for name, weights in learners[1].weights().items():
            for x, y in zip(weights, saved_weights[name], strict=True):
                np.testing.assert_array_equal(x, y, err_msg=name)
        for key, value in task.replay.state().items():
            np.testing.assert_array_equal(value, saved_replay[key], err_msg=key)

    def test_an_actor_process_acts_with_the_learners_encoder_and_policy(self):
        """Issue 33, end to end: an actor process (its own TensorFlow, encoder, policy and render
        worker, configured from the learner's gin config) acts as the learner's networks do.
        With exploration off (sigma 0, no decaying noise) and the weights fixed (rates 0, so every weight version
        is the same), each action in the frame replay is the learner's
        policy(encoder(stack)) of the observation it was taken in."""
        from expframe import config  # pylint: disable=import-outside-toplevel
        config.parse(["experiments/d4pg_control_pixels.gin"], [
            "control_suite.size = 16", "control_suite.frame_stack = 2", "control_suite.action_repeat = 25",
            "drq_encoder.num_filters = 4", "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8",
            "d4pg_policy.layer_sizes = (16,)", "d4pg_critic.layer_sizes = (16,)", "D4PGTask.min_replay_size = 60",
            "D4PGTask.max_replay_size = 500", "D4PGTask.num_actors = 1", "D4PGTask.actor_sigmas = (0.0,)",
            "D4PGTask.initial_sigma = None",  # the file's noise decays from 1.0 to each actor's sigma
            "D4PGTask.weights_every = 10", "actor/keras.optimizers.Adam.learning_rate = 0.0",
            "critic/keras.optimizers.Adam.learning_rate = 0.0"])
        rep = xf.Replicator("cpu", 1)
        task = D4PGTask()
        try:
            task.setup(rep, BATCH, seed=3, deterministic=False)
            with rep.scope():
                task.build()
            iterator = iter(rep.distribute(task.train_input_fn, BATCH))
            for step in (0, 1):
                task.before_train_steps(step, 1)
                rep.run_steps(task.train_step, iterator, 1)
                task.after_train_steps(step + 1)
            replay = task.replay
            rows = np.flatnonzero(replay._valid)  # pylint: disable=protected-access
            self.assertGreaterEqual(len(rows), 60)
            stacks = replay.stacks(replay._ids[rows])  # pylint: disable=protected-access
            expected = task.policy(task.observation_network(stacks)).numpy()
            np.testing.assert_allclose(replay._action[rows], expected, atol=1e-5)  # pylint: disable=protected-access
            self.assertGreater(float(np.abs(expected).max()), 1e-3)   # not a trivial all-zero policy
            self.assertEqual(task.actor_pool.alive, 1)
        finally:
            task.close()
            gin.clear_config()
