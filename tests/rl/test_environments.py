"""Control Suite environments: names, flat observations, action scaling and repeat, seeding."""

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
