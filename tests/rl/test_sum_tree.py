"""Sum tree: sampling in proportion to priority (a chi-square test, fixed seed), updates, restore."""

import numpy as np

from expframe.rl.sum_tree import SumTree
from tests.support import TestCase


def _chi_square(observed, expected):
    return float(np.sum((observed - expected) ** 2 / expected))


class SumTreeTest(TestCase):

    def test_find_walks_cumulative_ranges(self):
        tree = SumTree(5)
        tree.set([0, 1, 2, 3, 4], [1.0, 2.0, 0.0, 3.0, 4.0])
        self.assertEqual(tree.total, 10.0)
        # Ranges: leaf 0 [0, 1), leaf 1 [1, 3), leaf 2 empty, leaf 3 [3, 6), leaf 4 [6, 10).
        np.testing.assert_array_equal(tree.find([0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99]),
                                      [0, 0, 1, 1, 3, 3, 4, 4])

    def test_sampling_is_proportional_to_priority(self):
        priorities = np.array([1.0, 2.0, 3.0, 4.0, 0.0, 10.0, 0.5, 7.5])
        tree = SumTree(len(priorities))
        tree.set(np.arange(len(priorities)), priorities)
        rng = np.random.default_rng(1234)
        counts = np.bincount(np.concatenate([tree.sample(64, rng) for _ in range(2000)]),
                             minlength=len(priorities))
        self.assertEqual(counts[4], 0)  # zero priority: never sampled
        nonzero = priorities > 0
        expected = priorities[nonzero] / priorities.sum() * counts.sum()
        # Chi-square over the 7 sampled leaves (6 degrees of freedom): the statistic
        # exceeds 22.46 with probability 0.001 if sampling is proportional. Stratified
        # sampling is, if anything, less variable than multinomial, so the test is
        # conservative. A uniform sampler scores in the thousands.
        self.assertLess(_chi_square(counts[nonzero], expected), 22.46)
        uniform = np.full(nonzero.sum(), counts.sum() / nonzero.sum())
        self.assertGreater(_chi_square(uniform, expected), 1000.0)

    def test_updates_change_sums_and_sampling(self):
        tree = SumTree(6)   # not a power of two
        tree.set(np.arange(6), 1.0)
        tree.set([2, 2, 5], [9.0, 4.0, 0.0])   # a repeated index: the last value wins
        np.testing.assert_allclose(tree.leaves, [1, 1, 4, 1, 1, 0])
        self.assertEqual(tree.total, 8.0)
        tree.set([1], [3.0])                   # the one-index path
        self.assertEqual(tree.total, 10.0)
        rng = np.random.default_rng(0)
        counts = np.bincount(np.concatenate([tree.sample(10, rng) for _ in range(1000)]), minlength=6)
        self.assertEqual(counts[5], 0)
        np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.3, 0.4, 0.1, 0.1, 0.0], atol=0.02)

    def test_restore_rebuilds_the_sums(self):
        tree = SumTree(7)
        rng = np.random.default_rng(3)
        tree.set(np.arange(7), rng.uniform(0, 1, 7))
        copy = SumTree(7)
        copy.restore(tree.state())
        self.assertAlmostEqual(copy.total, tree.total)
        values = rng.uniform(0, tree.total, 100)
        np.testing.assert_array_equal(copy.find(values), tree.find(values))

    def test_bad_input(self):
        tree = SumTree(3)
        with self.assertRaises(IndexError):
            tree.set([3], [1.0])
        with self.assertRaises(ValueError):
            tree.set([0], [-1.0])
        with self.assertRaises(ValueError):
            tree.sample(4, np.random.default_rng(0))  # all zero
