"""The D4PG learner: 1 and 2 replicas give the same weights (deterministic mode), target copies,
TD errors become priorities, the acting state round-trips through a checkpoint, evaluation."""

import functools

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # disable_op_determinism is not public

import expframe as xf
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from expframe.rl import losses
from expframe.rl.environments import control_suite
from expframe.tasks.d4pg import D4PGTask
from tests.support import TestCase

BATCH = 32


def _task(**overrides):
    kwargs = dict(environment=functools.partial(control_suite, name="cartpole/balance"),
                  policy_network=functools.partial(d4pg_policy, layer_sizes=(32, 16)),
                  critic_network=functools.partial(d4pg_critic, layer_sizes=(32, 16), num_atoms=11,
                                                   v_min=-20.0, v_max=20.0),
                  actor_optimizer=lambda: keras.optimizers.Adam(1e-3),
                  critic_optimizer=lambda: keras.optimizers.Adam(1e-3),
                  n_step=3, min_replay_size=200, target_update_period=2, samples_per_insert=8.0, eval_episodes=1)
    kwargs.update(overrides)
    return D4PGTask(**kwargs)


class _Learner:
    """What the trainer does around a task: build in scope, distribute the input, host calls."""

    def __init__(self, num_replicas, seed=0, **overrides):
        keras.utils.set_random_seed(seed)
        self.rep = xf.Replicator("cpu", num_replicas)
        self.task = _task(**overrides)
        # Actor processes do not repeat: deterministic mode refuses them.
        self.task.setup(self.rep, BATCH, seed=seed, deterministic=not overrides.get("num_actors"))
        with self.rep.scope():
            self.task.build()
        self.iterator = iter(self.rep.distribute(self.task.train_input_fn, BATCH))
        self.step = 0

    def run(self, num_steps):
        """num_steps replicated train steps in one tf.function call (as the trainer runs them)."""
        return self.rep.run_steps(self.task.train_step, self.iterator, num_steps)

    def host_call(self, num_steps):
        self.task.before_train_steps(self.step, num_steps)
        out = self.run(num_steps)
        self.step += num_steps
        out.update(self.task.after_train_steps(self.step))
        return out

    def weights(self):
        return {name: [np.asarray(w) for w in getattr(self.task, name).get_weights()]
                for name in ("policy", "critic", "target_policy", "target_critic")}


class D4PGLearnerTest(TestCase):

    def test_two_replicas_equal_one_in_deterministic_mode(self):
        tf.config.experimental.enable_op_determinism()
        try:
            results = {}
            for replicas in (1, 2):
                # Plain SGD: unlike Adam, it would show gradients summed over replicas
                # instead of averaged.
                learner = _Learner(replicas, actor_optimizer=lambda: keras.optimizers.SGD(0.05),
                                   critic_optimizer=lambda: keras.optimizers.SGD(0.05))
                initial = learner.weights()
                # One host call: its 3 batches are drawn before any priority update, so
                # both replica counts read exactly the same batches.
                metrics = learner.host_call(3)
                results[replicas] = (initial, learner.weights(), learner.task.replay.priorities(), metrics)
                if replicas == 2:
                    for name in ("policy", "critic", "target_policy", "target_critic"):
                        for variable in getattr(learner.task, name).weights:
                            self.assertSameValuePerReplica(learner.rep, variable.value)
        finally:
            tf_config.disable_op_determinism()
        (init1, after1, priorities1, metrics1), (init2, after2, priorities2, metrics2) = results[1], results[2]
        for name in after1:
            for a, b in zip(init1[name], init2[name], strict=True):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(after1[name], after2[name], strict=True):
                np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5, err_msg=name)
        # The steps moved the networks, and the target copy at step 2 moved the targets.
        self.assertGreater(max(np.abs(a - b).max() for a, b in zip(init1["critic"], after1["critic"], strict=True)),
                           1e-3)
        self.assertGreater(max(np.abs(a - b).max() for a, b in
                               zip(init1["target_critic"], after1["target_critic"], strict=True)), 1e-4)
        np.testing.assert_allclose(priorities1, priorities2, rtol=1e-4)
        self.assertFalse(np.allclose(priorities1, 1.0))
        self.assertAlmostEqual(metrics1["loss"], metrics2["loss"], places=5)
        self.assertEqual(metrics1["replay_size"], metrics2["replay_size"])

    def test_target_copies_and_priorities_from_td_errors(self):
        learner = _Learner(1, samples_per_insert=16.0)
        task = learner.task
        initial = learner.weights()
        task.before_train_steps(0, 1)
        # The TD errors the step should send back, computed here on the sampled rows with
        # the initial weights (the step copies them into the targets first).
        _, rows, _ = task._in_flight  # pylint: disable=protected-access
        data = {k: tf.constant(v[rows]) for k, v in task.replay.state().items() if k.startswith("data/")}
        next_logits = task.critic([data["data/next_observation"], task.policy(data["data/next_observation"])])
        target = losses.categorical_projection(task.support, tf.nn.softmax(next_logits), data["data/reward"],
                                               data["data/discount"])
        _, td = losses.categorical_td(task.support, task.critic([data["data/observation"], data["data/action"]]),
                                      target)
        learner.run(1)
        learner.step = 1
        task.after_train_steps(1)
        expected = (np.abs(td.numpy()) + task.replay.epsilon) ** task.replay.alpha
        np.testing.assert_allclose(task.replay.priorities()[rows], expected, rtol=1e-4)
        after_one = learner.weights()
        for a, b in zip(initial["critic"], after_one["target_critic"], strict=True):
            np.testing.assert_array_equal(a, b)        # copied at step 0, before the update
        learner.host_call(1)                           # step 1: no copy (period 2)
        for a, b in zip(initial["policy"], learner.weights()["target_policy"], strict=True):
            np.testing.assert_array_equal(a, b)
        before_copy = learner.weights()
        learner.host_call(1)                           # step 2: copies the weights after 2 updates
        for a, b in zip(before_copy["policy"], learner.weights()["target_policy"], strict=True):
            np.testing.assert_array_equal(a, b)
        # Acting kept pace: min_replay_size + 3 steps * 32 samples / 16 per insert.
        self.assertEqual(task.actor.env_steps, 200 + 6)

    def test_soft_target_updates_copy_at_step_0_then_move_a_fraction_tau(self):
        """`target_update_tau` < 1 (DrQ's Polyak averaging): step 0 copies the online
        networks; each later update moves the targets tau of the way to them."""
        learner = _Learner(1, samples_per_insert=16.0, target_update_tau=0.25)
        initial = learner.weights()
        learner.host_call(1)                           # step 0: a copy, before the update
        for name in ("policy", "critic"):
            for a, b in zip(initial[name], learner.weights()[f"target_{name}"], strict=True):
                np.testing.assert_array_equal(a, b)
        learner.host_call(1)                           # step 1: none (period 2)
        before = learner.weights()
        learner.host_call(1)                           # step 2: tau of the way
        after = learner.weights()
        for name in ("policy", "critic"):
            for online, target, moved in zip(before[name], before[f"target_{name}"], after[f"target_{name}"],
                                             strict=True):
                np.testing.assert_allclose(moved, 0.25 * online + 0.75 * target, rtol=1e-5, atol=1e-7)
            self.assertFalse(all(np.array_equal(o, m) for o, m in zip(before[name], after[f"target_{name}"],
                                                                      strict=True)))
        with self.assertRaisesRegex(xf.ConfigError, "target_update_tau"):
            _task(target_update_tau=0.0)

    def test_preactivation_penalty_pulls_a_saturated_policy_back(self):
        """`preactivation_penalty` (HER's): a policy saturated at tanh(10) has no gradient left
        from the critic (1 - tanh(10)^2 ~ 8e-9) and stays there; the penalty's gradient,
        2 * lambda * x, brings it back to where the critic's gradient reaches it."""
        moved = {}
        for penalty in (0.0, 0.1):
            learner = _Learner(1, samples_per_insert=16.0, preactivation_penalty=penalty,
                               actor_optimizer=lambda: keras.optimizers.SGD(0.05))
            bias = learner.task.policy.get_layer("policy_action").bias
            bias.assign([10.0])
            metrics = learner.host_call(3)
            moved[penalty] = 10.0 - float(bias.numpy()[0])
            if penalty:
                # Three SGD steps of 0.05 * 2 * 0.1 * x on the bias, x ~ 10 (the torso's output
                # through a near-zero kernel adds little).
                self.assertGreater(metrics["policy_preactivation_rms"], 9.0)
            else:
                self.assertNotIn("policy_preactivation_rms", metrics)
        self.assertLess(abs(moved[0.0]), 1e-4)
        self.assertAlmostEqual(moved[0.1], 3 * 0.05 * 2 * 0.1 * 10.0, delta=0.02)
        with self.assertRaisesRegex(xf.ConfigError, "D4PGTask.preactivation_penalty=-1.0 must be >= 0"):
            _task(preactivation_penalty=-1.0)

        def linear_policy(observation_size, action_size):
            inputs = keras.Input((observation_size,))
            return keras.Model(inputs, keras.layers.Dense(action_size, name="plain")(inputs), name="linear")
        with self.assertRaisesRegex(xf.ConfigError, "last layer is a tanh activation .* 'linear' ends in 'plain'"):
            _Learner(1, policy_network=linear_policy, preactivation_penalty=0.01)

    def test_in_process_acting_decays_sigma_with_the_learner_step(self):
        """`initial_sigma` (DrQ-v2's schedule): the in-process actor acts each host call with
        the sigma of the call's first step, falling linearly to `sigma`; logged as `sigma`."""
        learner = _Learner(1, samples_per_insert=16.0, sigma=0.2, initial_sigma=1.0, sigma_decay_steps=4)
        first = learner.host_call(2)
        self.assertEqual(learner.task.actor.sigma, 1.0)     # acted before step 0
        self.assertAlmostEqual(first["sigma"], 0.6)         # logged at step 2
        learner.host_call(2)
        self.assertAlmostEqual(learner.task.actor.sigma, 0.6)
        learner.host_call(2)
        self.assertAlmostEqual(learner.task.actor.sigma, 0.2)
        self.assertNotIn("sigma", _Learner(1).host_call(1))   # constant sigma: not logged
        with self.assertRaisesRegex(xf.ConfigError, "D4PGTask.sigma_decay_steps=0 must be a positive integer"):
            _task(initial_sigma=1.0)

    def test_in_process_acting_logs_its_weight_lag_over_the_whole_run(self):
        """Issue 33: acting in the learner's process logs the actor processes' lag metrics:
        every transition acted with the weights of the step it is inserted at (lag 0), counted
        since the start, not only over the host call that ends a log interval."""
        learner = _Learner(1, samples_per_insert=16.0)
        first = learner.host_call(2)
        second = learner.host_call(2)
        self.assertEqual(first["weight_lag_0"], 200 + 4)          # min_replay_size + 2 steps * 32 / 16
        self.assertEqual(second["weight_lag_0"], second["env_steps"])
        self.assertEqual((second["weight_lag_0"], second["weight_lag_1"], second["weight_lag_mean"]),
                         (200 + 8, 0.0, 0.0))

    def test_acting_state_round_trips_through_a_checkpoint(self):
        learner = _Learner(1)
        learner.host_call(2)
        path = tf.train.Checkpoint(**learner.task.trackables()).write(self.get_temp_dir() + "/ckpt")
        fresh = _Learner(1, seed=5)
        tf.train.Checkpoint(**fresh.task.trackables()).read(path).assert_consumed()
        a, b = learner.task, fresh.task
        self.assertEqual((a.actor.env_steps, a.actor.episodes, a.replay.inserted),
                         (b.actor.env_steps, b.actor.episodes, b.replay.inserted))
        for key, value in a.replay.state().items():
            if key != "rng":
                np.testing.assert_array_equal(value, b.replay.state()[key], err_msg=key)
        for x, y in zip(a.replay.sample(16, 0.5)["index"], b.replay.sample(16, 0.5)["index"], strict=True):
            self.assertEqual(x, y)
        for name, weights in learner.weights().items():
            for x, y in zip(weights, fresh.weights()[name], strict=True):
                np.testing.assert_array_equal(x, y)
        # (main.py's resume test runs the restored learner on.)

    def test_evaluate_returns_the_noiseless_episode_return(self):
        learner = _Learner(1)
        result = learner.task.evaluate(runner=None)
        self.assertEqual(set(result), {"episode_return"})
        self.assertTrue(0.0 < result["episode_return"] <= 1000.0)

    def test_bad_values_are_config_errors(self):
        for binding, value in (("n_step", 0), ("discount", 1.5), ("max_replay_size", 10), ("sigma", -1.0),
                               ("actors_per_process", 0), ("weights_every", 2.5)):
            with self.assertRaisesRegex(xf.ConfigError, f"D4PGTask.{binding}"):
                _task(**{binding: value})
