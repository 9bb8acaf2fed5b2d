"""N-step transitions: returns and discounts, across episode ends (truncation and terminal)."""

import numpy as np

from expframe.rl.adders import NStepAdder
from tests.support import TestCase


class _Recorder:
    def __init__(self):
        self.rows = []

    def add(self, **row):
        self.rows.append(row)


def _episode(adder, first, steps):
    """steps: (reward, env discount, next observation id); observations are [id]."""
    adder.start(np.array([first], np.float32))
    for i, (reward, discount, next_id) in enumerate(steps):
        adder.add(np.array([next_id * 10.0]), reward, discount, np.array([next_id], np.float32), i == len(steps) - 1)


class NStepAdderTest(TestCase):

    def test_returns_and_discounts_across_episode_ends(self):
        replay = _Recorder()
        adder = NStepAdder(replay, n_step=3, discount=0.5)
        # Episode 1: observations 0..4, rewards 1..4, truncated by a time limit (d = 1).
        _episode(adder, 0, [(1.0, 1.0, 1), (2.0, 1.0, 2), (3.0, 1.0, 3), (4.0, 1.0, 4)])
        # Episode 2: observations 10..12, rewards 1, 1, ending in a terminal state (d = 0).
        _episode(adder, 10, [(1.0, 1.0, 11), (1.0, 0.0, 12)])
        got = [(float(r["observation"][0]), float(r["reward"]), float(r["discount"]), float(r["next_observation"][0]))
               for r in replay.rows]
        expected = [
            (0, 1 + 0.5 * 2 + 0.25 * 3, 0.125, 3),    # full 3-step transitions
            (1, 2 + 0.5 * 3 + 0.25 * 4, 0.125, 4),
            (2, 3 + 0.5 * 4, 0.25, 4),                # the episode ended: shorter, gamma ** m
            (3, 4, 0.5, 4),
            (10, 1 + 0.5 * 1, 0.0, 12),               # a terminal: no bootstrap
            (11, 1, 0.0, 12),
        ]
        self.assertEqual(len(got), len(expected))
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-6)
        # Actions are those taken at each transition's first step.
        np.testing.assert_array_equal([float(r["action"][0]) for r in replay.rows], [10, 20, 30, 40, 110, 120])

    def test_mid_window_discount_scales_later_rewards(self):
        replay = _Recorder()
        adder = NStepAdder(replay, n_step=2, discount=0.9)
        _episode(adder, 0, [(1.0, 0.5, 1), (2.0, 1.0, 2), (3.0, 1.0, 3)])
        first = replay.rows[0]
        self.assertAlmostEqual(float(first["reward"]), 1.0 + 0.9 * 0.5 * 2.0, places=5)
        self.assertAlmostEqual(float(first["discount"]), 0.9 * 0.5 * 0.9, places=6)

    def test_one_step_and_unfinished_episodes(self):
        replay = _Recorder()
        adder = NStepAdder(replay, n_step=1, discount=0.99)
        adder.start(np.zeros(1))
        adder.add(np.zeros(1), 1.0, 1.0, np.ones(1), False)
        self.assertEqual(len(replay.rows), 1)
        self.assertAlmostEqual(float(replay.rows[0]["discount"]), 0.99, places=6)
        adder = NStepAdder(replay, n_step=5, discount=0.99)
        adder.start(np.zeros(1))
        adder.add(np.zeros(1), 1.0, 1.0, np.ones(1), False)
        adder.start(np.zeros(1))          # a new episode drops the unfinished one's steps
        adder.add(np.zeros(1), 1.0, 1.0, np.ones(1), True)
        self.assertEqual(len(replay.rows), 2)
        with self.assertRaises(ValueError):
            NStepAdder(replay, n_step=0, discount=0.9)

    def test_state_carries_the_pending_steps_of_the_open_episode(self):
        """An adder restored mid-episode (from `state()`) writes the transitions the saved one
        writes: the n - 1 pending steps are not lost."""
        steps = [(float(i), 1.0, i + 1) for i in range(3)]
        later = [(float(i), 0.0 if i == 6 else 1.0, i + 1) for i in range(3, 7)]
        saved_rows, restored_rows = _Recorder(), _Recorder()
        saved = NStepAdder(saved_rows, n_step=4, discount=0.9)
        saved.start(np.array([0.0], np.float32))
        for reward, discount, next_id in steps:
            saved.add(np.array([next_id * 10.0]), reward, discount, np.array([next_id], np.float32), False)
        state = saved.state()
        self.assertEqual((len(saved_rows.rows), len(state["pending_reward"])), (0, 3))
        restored = NStepAdder(restored_rows, n_step=4, discount=0.9)
        restored.restore(state)
        for adder in (saved, restored):
            for i, (reward, discount, next_id) in enumerate(later):
                adder.add(np.array([next_id * 10.0]), reward, discount, np.array([next_id], np.float32),
                          i == len(later) - 1)
        self.assertEqual(len(restored_rows.rows), 7)   # the 3 pending steps' transitions among them
        for got, expected in zip(restored_rows.rows, saved_rows.rows, strict=True):
            for field in expected:
                np.testing.assert_array_equal(got[field], expected[field], err_msg=field)
        between = NStepAdder(_Recorder(), n_step=4, discount=0.9)
        between.restore(saved.state())   # after the episode ended: nothing open, nothing pending
        self.assertEqual(len(between.state()["pending_reward"]), 0)
        with self.assertRaisesRegex(RuntimeError, "before start"):
            between.add(np.zeros(1), 1.0, 1.0, np.ones(1), False)
