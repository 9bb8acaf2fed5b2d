"""Proportional prioritised replay (Schaul et al. 2016, "Prioritized Experience Replay").

Transitions live in fixed numpy arrays of `capacity` rows, written in a ring: when
full, the oldest row is overwritten (the capacity bound). Each row's priority is
p_i = (|delta_i| + epsilon) ** alpha, kept in a sum tree; a row is sampled with
probability P(i) = p_i / sum_k p_k and weighted by the importance-sampling weight
w_i = (N * P(i)) ** -beta / max_batch w, which undoes the bias of sampling by priority
(beta = 1: fully) while the max keeps updates no larger than uniform sampling's.
New rows get the largest priority seen so far, so every transition is sampled soon.

Every row also keeps the id of the item written there (a running insert count), so a
priority update for a row that has since been overwritten is dropped.

    replay = PrioritizedReplay(1000, {"observation": (5,), "action": (1,), ...}, seed=0)
    replay.add(observation=obs, action=act, ...)          # one transition or a batch
    batch = replay.sample(256, beta=0.4)                    # arrays + "index", "item", "weight"
    replay.update_priorities(batch["index"], batch["item"], np.abs(td_errors))
"""

import json
from typing import Dict, Sequence

import numpy as np

from expframe.rl.sum_tree import SumTree


class PrioritizedReplay:
    """A bounded replay of transitions sampled in proportion to priority.

    Args:
      capacity: rows kept; the oldest is overwritten when full.
      fields: name -> shape of one row (float32), e.g. {"observation": (5,), "reward": ()}.
      priority_exponent: alpha; 0 samples uniformly.
      epsilon: added to |delta| so that no row's priority is zero.
      seed: the sampler's random state.
    """

    def __init__(self, capacity: int, fields: Dict[str, Sequence[int]], priority_exponent: float = 0.6,
                 epsilon: float = 1e-6, seed: int = 0):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"replay capacity must be a positive integer, got {capacity!r}.")
        if priority_exponent < 0:
            raise ValueError(f"priority_exponent must be >= 0, got {priority_exponent!r}.")
        self.capacity = capacity
        self.alpha = float(priority_exponent)
        self.epsilon = float(epsilon)
        self._shapes = {name: tuple(shape) for name, shape in fields.items()}
        self._data = {name: np.zeros((capacity,) + shape, np.float32) for name, shape in self._shapes.items()}
        self._items = np.full(capacity, -1, np.int64)  # id of the item in each row; -1: empty
        self._tree = SumTree(capacity)
        self._rng = np.random.default_rng(seed)
        self.inserted = 0          # items ever added; the next one's id
        self.max_priority = 1.0    # largest |delta| + epsilon seen (before the exponent)

    @property
    def size(self) -> int:
        """Rows that hold a transition."""
        return min(self.inserted, self.capacity)

    def __len__(self) -> int:
        return self.size

    def add(self, **arrays: np.ndarray) -> np.ndarray:
        """Adds one transition (arrays of the row shapes) or a batch (with a leading axis).

        Returns:
          The rows written.
        """
        if set(arrays) != set(self._shapes):
            raise ValueError(f"replay.add needs exactly the fields {sorted(self._shapes)}, got {sorted(arrays)}.")
        first = next(iter(self._shapes))
        count = 1 if np.ndim(arrays[first]) == len(self._shapes[first]) else len(arrays[first])
        items = self.inserted + np.arange(count, dtype=np.int64)
        rows = items % self.capacity
        for name, shape in self._shapes.items():
            self._data[name][rows] = np.asarray(arrays[name], np.float32).reshape((count,) + shape)
        self._items[rows] = items
        self._tree.set(rows, self.max_priority ** self.alpha)
        self.inserted += count
        return rows

    def sample(self, batch_size: int, beta: float) -> Dict[str, np.ndarray]:
        """`batch_size` transitions drawn by priority, with their importance weights.

        Returns:
          The fields (float32 arrays with a leading batch axis) plus "index" (rows),
          "item" (item ids, for `update_priorities`) and "weight" (float32 importance
          weights, max 1).
        """
        if self.size == 0:
            raise ValueError("replay.sample on an empty replay.")
        rows = self._tree.sample(batch_size, self._rng)
        probabilities = self._tree.get(rows) / self._tree.total
        weights = (self.size * probabilities) ** -float(beta)
        out = {name: data[rows] for name, data in self._data.items()}
        out["index"] = rows
        out["item"] = self._items[rows].copy()
        out["weight"] = (weights / weights.max()).astype(np.float32)
        return out

    def update_priorities(self, rows: np.ndarray, items: np.ndarray, td_errors: np.ndarray) -> int:
        """Sets p = (|td| + epsilon) ** alpha for rows that still hold `items`.

        Rows overwritten since they were sampled are skipped; with a row repeated, the
        last update wins. Returns the number of rows updated.
        """
        rows, items = np.asarray(rows, np.int64), np.asarray(items, np.int64)
        raw = np.abs(np.asarray(td_errors, np.float64)) + self.epsilon
        if not np.all(np.isfinite(raw)):
            raise ValueError("replay.update_priorities got non-finite TD errors.")
        current = self._items[rows] == items
        if np.any(current):
            self._tree.set(rows[current], raw[current] ** self.alpha)
            self.max_priority = max(self.max_priority, float(raw[current].max()))
        return int(current.sum())

    def priorities(self) -> np.ndarray:
        """The sampling priorities p_i of the filled rows (for tests and inspection)."""
        return self._tree.leaves[:self.size].copy()

    # -- state for checkpoints ---------------------------------------------------------

    def state(self) -> Dict[str, np.ndarray]:
        """The filled rows, priorities, counters and sampler state, as numpy arrays."""
        size = self.size
        out = {f"data/{name}": data[:size] for name, data in self._data.items()}
        out.update(items=self._items[:size], priorities=self._tree.leaves[:size].copy(),
                   counters=np.array([self.inserted, self.capacity], np.int64),
                   max_priority=np.array(self.max_priority, np.float64),
                   rng=np.array(json.dumps(self._rng.bit_generator.state)))
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Loads what `state()` returned, into a replay of the same capacity and fields."""
        inserted, capacity = (int(v) for v in state["counters"])
        if capacity != self.capacity:
            raise ValueError(f"the checkpoint's replay has capacity {capacity}, this run's {self.capacity}: "
                             "resume with the replay capacity the run started with.")
        size = min(inserted, capacity)
        for name, data in self._data.items():
            saved = state[f"data/{name}"]
            if saved.shape != (size,) + self._shapes[name]:
                raise ValueError(f"the checkpoint's replay field {name!r} has shape {saved.shape[1:]}, "
                                 f"this run's {self._shapes[name]} (another environment?).")
            data[:size] = saved
        self._items[:] = -1
        self._items[:size] = state["items"]
        leaves = np.zeros(capacity, np.float64)
        leaves[:size] = state["priorities"]
        self._tree.restore(leaves)
        self.inserted = inserted
        self.max_priority = float(state["max_priority"])
        self._rng.bit_generator.state = json.loads(str(state["rng"]))

