"""Control Suite environments: names, flat observations, action scaling and repeat, seeding, and
their state (for checkpoints): a restored environment steps as the saved one, to the bit."""

import numpy as np

from expframe.errors import ConfigError
from expframe.rl.environments import control_suite
from tests.support import TestCase


class ControlSuiteTest(TestCase):

    def test_unknown_domain_or_task_lists_the_valid_names(self):
        with self.assertRaisesRegex(ConfigError, r"unknown domain 'cartpol'.*cartpole.*cartpole/balance") as e:
            control_suite(name="cartpol/balance")
        # main.py prints the first line (gin appends where the configurable was called).
        self.assertIn("walker/walk", str(e.exception).splitlines()[0])
        with self.assertRaisesRegex(ConfigError, r"no task 'balanse'.*cartpole/balance, cartpole/balance_sparse"):
            control_suite(name="cartpole/balanse")
        with self.assertRaisesRegex(ConfigError, "no task ''"):
            control_suite(name="cartpole")
        with self.assertRaisesRegex(ConfigError, "action_repeat"):
            control_suite(name="cartpole/balance", action_repeat=0)

    def test_flat_observations_and_seeded_episodes(self):
        env = control_suite(name="cartpole/balance", seed=3)
        self.assertEqual((env.observation_size, env.action_size), (5, 1))  # position 3 + velocity 2
        first = env.reset()
        self.assertEqual((first.shape, first.dtype), ((5,), np.float32))
        np.testing.assert_array_equal(control_suite(name="cartpole/balance", seed=3).reset(), first)
        self.assertFalse(np.array_equal(control_suite(name="cartpole/balance", seed=4).reset(), first))
        walker = control_suite(name="walker/walk")
        self.assertEqual((walker.observation_size, walker.action_size), (24, 6))

    def test_episode_ends_by_time_limit_with_discount_one(self):
        env = control_suite(name="cartpole/balance", action_repeat=4, seed=0)
        env.reset()
        steps, last = 0, False
        while not last:
            _, reward, discount, last = env.step(np.zeros(1))
            steps += 1
            self.assertEqual(discount, 1.0)
            self.assertTrue(0.0 <= reward <= 4.0)
        self.assertEqual(steps, 250)       # 1000 control steps / 4
        with self.assertRaisesRegex(RuntimeError, "reset"):
            env.step(np.zeros(1))

    def test_action_repeat_equals_repeated_steps(self):
        single = control_suite(name="cartpole/swingup", seed=1)
        repeated = control_suite(name="cartpole/swingup", action_repeat=3, seed=1)
        single.reset(), repeated.reset()
        action = np.array([0.7])
        total = 0.0
        for _ in range(3):
            observation, reward, _, _ = single.step(action)
            total += reward
        got, reward3, _, _ = repeated.step(action)
        np.testing.assert_allclose(got, observation)
        self.assertAlmostEqual(reward3, total)

    def test_actions_in_unit_range_are_rescaled_to_the_bounds(self):
        env = control_suite(name="cartpole/balance", seed=0)
        env.reset()
        env.step(np.array([5.0]))          # clipped to 1 -> the task's maximum
        np.testing.assert_allclose(env._env.physics.data.ctrl, env._high)  # pylint: disable=protected-access
        env.step(np.array([0.0]))          # the middle of [min, max]
        np.testing.assert_allclose(env._env.physics.data.ctrl, (env._low + env._high) / 2)  # pylint: disable=protected-access

    def _play(self, env, actions, opened=True):
        """Steps `env` through `actions`, starting episodes as they end; what it returned."""
        out = []
        for action in actions:
            if not opened:
                out.append(("reset", env.reset()))
                opened = True
                continue
            observation, reward, discount, last = env.step(action)
            out.append((observation, reward, discount, last))
            opened = not last
        return out

    def test_state_restores_the_episode_to_the_bit(self):
        """Physics, the task's random state (the next episodes' starts) and the step within the
        episode (its time limit): a restored environment of another seed steps as the saved one."""
        actions = np.random.default_rng(0).uniform(-1.0, 1.0, (130, 1))
        for name, at in (("cartpole/swingup", 23), ("cartpole/swingup", 40), ("walker/walk", 17)):
            saved = control_suite(name=name, action_repeat=25, seed=3)
            saved.reset()
            played = self._play(saved, np.resize(actions, (at, saved.action_size)))
            opened = not (played and played[-1][-1] is True)   # at 40 an episode has just ended
            state = saved.state()
            expected = self._play(saved, np.resize(actions, (100, saved.action_size)), opened)
            restored = control_suite(name=name, action_repeat=25, seed=9)
            restored.reset()
            restored.step(np.ones(restored.action_size))   # somewhere else
            restored.restore(state)
            got = self._play(restored, np.resize(actions, (100, saved.action_size)), opened)
            ends = sum(1 for g in got if g[-1] is True)
            self.assertGreaterEqual(ends, 2 if name.startswith("cartpole") else 0)   # 40-step episodes
            for g, e in zip(got, expected, strict=True):
                self.assertEqual(len(g), len(e))
                for x, y in zip(g, e, strict=True):
                    np.testing.assert_array_equal(x, y, err_msg=f"{name} restored at step {at}")

    def test_state_carries_the_model_values_a_task_sets_per_episode(self):
        saved = control_suite(name="reacher/easy", seed=3)   # a target placed at random per episode
        saved.reset()
        saved.step(np.zeros(2))
        state = saved.state()
        self.assertEqual([k for k in state if k.startswith("model/")], ["model/geom_pos"])
        restored = control_suite(name="reacher/easy", seed=4)
        restored.reset()
        restored.restore(state)
        action = np.array([0.3, -0.2])
        np.testing.assert_array_equal(restored.step(action)[0], saved.step(action)[0])
        with self.assertRaisesRegex(ValueError, "another task"):
            control_suite(name="cartpole/balance").restore(state)
