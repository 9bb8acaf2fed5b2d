"""Acting: the numpy policy equals Keras, noisy acting is deterministic by seed and feeds replay."""

import keras
import numpy as np

from expframe.models.d4pg import d4pg_policy
from expframe.rl.actors import PolicyExecutor, SynchronousActor, episode_returns
from expframe.rl.adders import NStepAdder
from expframe.rl.environments import control_suite
from expframe.rl.replay import PrioritizedReplay
from tests.support import TestCase


def _replay(obs=5, act=1):
    return PrioritizedReplay(5000, {"observation": (obs,), "action": (act,), "reward": (), "discount": (),
                                    "next_observation": (obs,)}, seed=0)


def _random_weights(model, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.3, w.shape).astype(np.float32) for w in model.get_weights()]


class PolicyExecutorTest(TestCase):

    def test_numpy_policy_equals_keras(self):
        keras.utils.set_random_seed(0)
        policy = d4pg_policy(observation_size=5, action_size=2, layer_sizes=(16, 8))
        executor = PolicyExecutor(policy, 5)
        self.assertTrue(executor.uses_numpy)
        executor.update(_random_weights(policy, 1))
        observations = np.random.default_rng(2).normal(size=(6, 5)).astype(np.float32)
        expected = policy(observations).numpy()
        got = np.stack([executor(o) for o in observations])
        np.testing.assert_allclose(got, expected, atol=1e-5)
        self.assertTrue(np.any(np.abs(expected) > 0.1))   # not trivially near zero

    def test_other_models_run_through_tensorflow(self):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(2, activation="tanh")(keras.layers.BatchNormalization()(inputs))
        executor = PolicyExecutor(keras.Model(inputs, outputs), 3)
        self.assertFalse(executor.uses_numpy)
        np.testing.assert_allclose(executor(np.ones(3, np.float32)), executor.policy(np.ones((1, 3)))[0], atol=1e-6)


class SynchronousActorTest(TestCase):

    def _actor(self, seed, sigma=0.3):
        keras.utils.set_random_seed(0)
        env = control_suite(name="cartpole/balance", seed=seed)
        replay = _replay()
        actor = SynchronousActor(env, PolicyExecutor(d4pg_policy(5, 1, (16,)), 5), NStepAdder(replay, 3, 0.99),
                                 sigma=sigma, seed=seed)
        return actor, replay

    def test_acting_is_deterministic_by_seed_and_fills_replay(self):
        actor, replay = self._actor(seed=7)
        actor.run(1200)                    # one 1000-step episode and 200 steps of the next
        self.assertEqual((actor.env_steps, actor.episodes), (1200, 1))
        self.assertEqual(len(replay), 1000 + 200 - 2)   # the open episode's last n-1 steps are pending
        self.assertEqual(len(actor.finished_returns()), 1)
        self.assertEqual(actor.finished_returns(), [])
        again, replay_again = self._actor(seed=7)
        again.run(1200)
        np.testing.assert_array_equal(replay.state()["data/action"], replay_again.state()["data/action"])
        other, replay_other = self._actor(seed=8)
        other.run(1200)
        self.assertFalse(np.array_equal(replay.state()["data/action"], replay_other.state()["data/action"]))
        actions = replay.state()["data/action"]
        self.assertTrue(np.all(np.abs(actions) <= 1.0))
        self.assertGreater(actions.std(), 0.2)   # the noise (sigma 0.3 around a near-zero policy)

    def test_state_round_trip_and_noiseless_returns(self):
        actor, _ = self._actor(seed=1)
        actor.run(50)
        state = actor.state()
        expected = [actor.select_action(np.zeros(5, np.float32)) for _ in range(3)]
        fresh, _ = self._actor(seed=2)
        fresh.restore(state)
        self.assertEqual(fresh.env_steps, 50)
        np.testing.assert_array_equal([fresh.select_action(np.zeros(5, np.float32)) for _ in range(3)], expected)
        env = control_suite(name="cartpole/balance", action_repeat=10, seed=0)
        returns = episode_returns(env, actor.policy, 2)
        self.assertEqual(len(returns), 2)
        self.assertTrue(all(0.0 < r <= 1000.0 for r in returns))

    def test_a_restored_actor_continues_the_episode_in_progress(self):
        """Its observation, return so far, the adder's pending steps and the environment's state
        come back: a restored actor (other seeds) writes what the saved one writes, through the
        episode's end, and reports the same returns."""
        def actor(seed):
            keras.utils.set_random_seed(0)
            env = control_suite(name="cartpole/swingup", action_repeat=25, seed=seed)   # 40-step episodes
            replay = _replay()
            return SynchronousActor(env, PolicyExecutor(d4pg_policy(5, 1, (16,)), 5), NStepAdder(replay, 5, 0.99),
                                    sigma=0.3, seed=seed), replay
        saved, saved_replay = actor(1)
        saved.run(57)
        self.assertEqual(len(saved.finished_returns()), 1)   # the first episode's
        written = saved_replay.size
        state = saved.state()
        self.assertTrue(state["open"])
        self.assertEqual(len(state["adder/pending_reward"]), 4)
        restored, restored_replay = actor(2)
        restored.run(3)   # its own episode: 3 steps pending in its adder, dropped by the restore
        self.assertTrue(restored.restore(state))
        for a in (saved, restored):
            a.run(50)
        self.assertEqual((restored.env_steps, restored.episodes), (saved.env_steps, saved.episodes))
        self.assertEqual(restored.finished_returns(), saved.finished_returns())
        self.assertEqual(restored_replay.size, saved_replay.size - written)
        for key, value in saved_replay.state().items():
            if key.startswith("data/"):
                np.testing.assert_array_equal(restored_replay.state()[key], value[written:], err_msg=key)
        # A state without the episode (an old checkpoint's): counters and noise only, a new episode next.
        old = {k: v for k, v in state.items() if k in ("counters", "rng")}
        self.assertFalse(restored.restore(old))
        self.assertIsNone(restored._observation)  # pylint: disable=protected-access
