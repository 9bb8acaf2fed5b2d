"""A sum tree: set leaf priorities and sample leaves in proportion to them, in O(log n).

The tree is an array of 2 * size float64 nodes (size: capacity rounded up to a power
of two); node 1 is the root, node i has children 2i and 2i + 1, and leaf j lives at
node size + j. Every inner node holds the sum of its children, so the root holds the
total priority, and a value u in [0, total) names the leaf whose cumulative range
[prefix, prefix + priority) contains it: descend left while u < left child's sum,
else subtract that sum and go right.

Updates recompute each touched parent from its two children (never by adding a
difference), so rounding errors do not pile up over millions of updates.
"""

import numpy as np


class SumTree:
    """Priorities of `capacity` leaves (initially 0) and proportional sampling.

    Example:
      tree = SumTree(4)
      tree.set([0, 1, 2], [1.0, 2.0, 1.0])
      tree.find(np.array([0.5, 1.5, 3.5]))       # -> [0, 1, 2]
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"SumTree capacity must be >= 1, got {capacity}.")
        self.capacity = int(capacity)
        self._size = 1 << max(0, (self.capacity - 1).bit_length())
        self._nodes = np.zeros(2 * self._size, np.float64)

    @property
    def total(self) -> float:
        """Sum of all priorities."""
        return float(self._nodes[1])

    @property
    def leaves(self) -> np.ndarray:
        """The priorities of the `capacity` leaves (a view: do not write into it)."""
        return self._nodes[self._size:self._size + self.capacity]

    def get(self, indices) -> np.ndarray:
        return self._nodes[self._size + np.asarray(indices, np.int64)]

    def set(self, indices, priorities) -> None:
        """Sets leaf priorities (>= 0, finite); with repeated indices the last one wins."""
        indices = np.atleast_1d(np.asarray(indices, np.int64))
        priorities = np.broadcast_to(np.asarray(priorities, np.float64), indices.shape)
        if indices.size == 0:
            return
        if indices.min() < 0 or indices.max() >= self.capacity:
            raise IndexError(f"SumTree leaf indices must be in [0, {self.capacity}), got {indices}.")
        if not np.all(np.isfinite(priorities)) or np.any(priorities < 0):
            raise ValueError(f"SumTree priorities must be finite and >= 0, got {priorities}.")
        nodes = self._size + indices
        self._nodes[nodes] = priorities  # numpy assigns in order: the last duplicate wins
        if nodes.size == 1:  # one insert per environment step: a plain loop is 10x faster
            node = int(nodes[0]) >> 1
            while node >= 1:
                self._nodes[node] = self._nodes[2 * node] + self._nodes[2 * node + 1]
                node >>= 1
            return
        nodes = np.unique(nodes >> 1)
        while nodes[0] >= 1:
            self._nodes[nodes] = self._nodes[2 * nodes] + self._nodes[2 * nodes + 1]
            if nodes[0] == 1:
                break
            nodes = np.unique(nodes >> 1)

    def find(self, values) -> np.ndarray:
        """Leaf indices whose cumulative priority range holds each value in [0, total)."""
        values = np.array(values, np.float64, copy=True, ndmin=1)
        nodes = np.ones(values.shape, np.int64)
        while nodes[0] < self._size:  # all paths have the same depth
            left = 2 * nodes
            left_sum = self._nodes[left]
            go_right = values >= left_sum
            values -= np.where(go_right, left_sum, 0.0)
            nodes = left + go_right
        leaves = nodes - self._size
        # Rounding can step onto a zero-priority leaf at a range's edge (or past the
        # last leaf); move it to the nearest leaf with priority.
        bad = self._nodes[nodes] <= 0
        if np.any(bad):
            leaves[bad] = [self._nearest_positive(j) for j in leaves[bad]]
        return leaves

    def _nearest_positive(self, leaf: int) -> int:
        positive = np.flatnonzero(self.leaves > 0)
        if positive.size == 0:
            raise ValueError("SumTree.find on a tree whose priorities are all zero.")
        return int(positive[np.argmin(np.abs(positive - leaf))])

    def sample(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """`batch_size` leaves, leaf i with probability priority_i / total.

        Stratified (Schaul et al. 2016): the total is split into batch_size equal
        segments and one value is drawn uniformly in each, which keeps the marginal
        probabilities exact and spreads one batch over the whole range.
        """
        total = self.total
        if total <= 0:
            raise ValueError("SumTree.sample on a tree whose priorities are all zero.")
        segment = total / batch_size
        values = (np.arange(batch_size) + rng.random(batch_size)) * segment
        return self.find(np.minimum(values, np.nextafter(total, 0.0)))

    # -- state for checkpoints ---------------------------------------------------------

    def state(self) -> np.ndarray:
        return self.leaves.copy()

    def restore(self, leaves: np.ndarray) -> None:
        """Sets all leaves at once and rebuilds the inner sums level by level."""
        if leaves.shape != (self.capacity,):
            raise ValueError(f"SumTree.restore: expected {self.capacity} leaves, got {leaves.shape}.")
        self._nodes[:] = 0.0
        self._nodes[self._size:self._size + self.capacity] = leaves
        size = self._size
        while size > 1:
            parents = np.arange(size // 2, size)
            self._nodes[parents] = self._nodes[2 * parents] + self._nodes[2 * parents + 1]
            size //= 2
