"""Prioritised replay: importance weights, priority updates, the capacity bound, state round trip."""

import numpy as np

from expframe.rl.replay import PrioritizedReplay
from tests.support import TestCase

FIELDS = {"observation": (2,), "reward": ()}


def _fill(replay, count, start=0):
    for i in range(start, start + count):
        replay.add(observation=np.array([i, -i], np.float32), reward=np.float32(i))


class PrioritizedReplayTest(TestCase):

    def test_new_rows_get_the_max_priority_and_updates_set_td_to_the_alpha(self):
        replay = PrioritizedReplay(8, FIELDS, priority_exponent=0.5, epsilon=0.0, seed=0)
        _fill(replay, 4)
        np.testing.assert_allclose(replay.priorities(), [1, 1, 1, 1])
        batch = replay.sample(4, beta=1.0)
        rows = np.array([0, 1, 2, 3])
        updated = replay.update_priorities(rows, rows, np.array([4.0, -9.0, 0.25, 1.0]))  # items == rows here
        self.assertEqual(updated, 4)
        np.testing.assert_allclose(replay.priorities(), [2.0, 3.0, 0.5, 1.0])  # |td| ** 0.5
        self.assertEqual(replay.max_priority, 9.0)
        _fill(replay, 1, start=4)
        self.assertAlmostEqual(float(replay.priorities()[4]), 3.0)  # the max so far, ** alpha
        self.assertEqual(set(batch), {"observation", "reward", "index", "item", "weight"})

    def test_importance_weights(self):
        replay = PrioritizedReplay(4, FIELDS, priority_exponent=1.0, epsilon=0.0, seed=0)
        _fill(replay, 4)
        replay.update_priorities(np.arange(4), np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
        batch = replay.sample(64, beta=0.5)
        probabilities = (batch["index"] + 1.0) / 10.0
        expected = (4 * probabilities) ** -0.5
        np.testing.assert_allclose(batch["weight"], expected / expected.max(), rtol=1e-6)
        # Sampled rows carry their own data.
        np.testing.assert_array_equal(batch["reward"], batch["index"].astype(np.float32))
        # beta = 0: no correction.
        np.testing.assert_array_equal(replay.sample(16, beta=0.0)["weight"], np.ones(16, np.float32))

    def test_sampling_follows_updated_priorities(self):
        replay = PrioritizedReplay(4, FIELDS, priority_exponent=1.0, epsilon=0.0, seed=1)
        _fill(replay, 4)
        replay.update_priorities(np.arange(4), np.arange(4), np.array([0.0, 0.0, 1.0, 3.0]))
        counts = np.bincount(np.concatenate([replay.sample(32, 0.4)["index"] for _ in range(200)]), minlength=4)
        self.assertEqual(counts[0] + counts[1], 0)
        self.assertAlmostEqual(counts[3] / counts.sum(), 0.75, delta=0.02)

    def test_capacity_bound_overwrites_the_oldest_and_drops_stale_updates(self):
        replay = PrioritizedReplay(3, FIELDS, seed=0)
        _fill(replay, 3)
        batch = replay.sample(3, beta=0.4)
        _fill(replay, 2, start=3)       # rows 0 and 1 now hold items 3 and 4
        self.assertEqual(len(replay), 3)
        self.assertEqual(replay.inserted, 5)
        rewards = sorted(float(r) for r in replay.sample(60, 0.4)["reward"])
        self.assertEqual(set(rewards), {2.0, 3.0, 4.0})
        updated = replay.update_priorities(batch["index"], batch["item"], np.full(3, 5.0))
        self.assertEqual(updated, int(np.sum(batch["item"] == 2)))  # only item 2 still lives

    def test_batch_add(self):
        replay = PrioritizedReplay(10, FIELDS, seed=0)
        rows = replay.add(observation=np.zeros((4, 2), np.float32), reward=np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(rows, [0, 1, 2, 3])
        self.assertEqual(len(replay), 4)

    def test_state_round_trip_continues_identically(self):
        replay = PrioritizedReplay(6, FIELDS, seed=5)
        _fill(replay, 9)
        replay.update_priorities(np.arange(6), replay.state()["items"], np.arange(6) + 0.5)
        state = replay.state()
        copy = PrioritizedReplay(6, FIELDS, seed=99)
        copy.restore(state)
        for _ in range(3):
            a, b = replay.sample(5, 0.7), copy.sample(5, 0.7)
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
        with self.assertRaisesRegex(ValueError, "capacity"):
            PrioritizedReplay(7, FIELDS).restore(state)
