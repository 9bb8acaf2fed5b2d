"""N-step transitions assembled from the steps of episodes, written into a replay.

For a step t whose episode continues for at least n more steps, the transition is

    (o_t, a_t, R_t, D_t, o_{t+n}),  R_t = sum_{k<n} (prod_{j<k} gamma d_{t+j}) r_{t+k},
                                    D_t = prod_{k<n} gamma d_{t+k},

with d the environment's per-step discount (0 at a terminal state, 1 otherwise): the
learner's target is R_t + D_t * Z(o_{t+n}, pi(o_{t+n})). A transition never spans two
episodes: when an episode ends at step T, the last n - 1 steps get the shorter
transitions that end at o_T (m = T - t < n terms, D_t = prod_{k<m} gamma d_{t+k}),
so a truncated episode (a time limit, d = 1) still bootstraps from its last state
with gamma ** m and a terminal one (d = 0) does not bootstrap.
"""

import collections
from typing import Dict, Optional

import numpy as np

FIELDS = ("observation", "action", "reward", "discount", "next_observation")


class NStepAdder:
    """Turns steps into n-step transitions and adds them to `replay` (see module docstring).

    Example:
      adder = NStepAdder(replay, n_step=5, discount=0.99)
      adder.start(observation)
      adder.add(action, reward, env_discount, next_observation, last)   # every step

    Args:
      replay: has `add(observation=, action=, reward=, discount=, next_observation=)`.
      n_step: steps per transition (1: one-step TD).
      discount: gamma, per environment step.
    """

    def __init__(self, replay, n_step: int, discount: float):
        if not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"n_step must be a positive integer, got {n_step!r}.")
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount!r}.")
        self._replay = replay
        self.n_step = n_step
        self.discount = float(discount)
        self._steps = collections.deque()  # (observation, action, reward, env discount)
        self._observation: Optional[np.ndarray] = None

    def start(self, observation: np.ndarray) -> None:
        """Begins an episode at `observation`; steps of an unfinished one are dropped."""
        self._steps.clear()
        self._observation = np.asarray(observation, np.float32)

    def add(self, action: np.ndarray, reward: float, discount: float, next_observation: np.ndarray,
            last: bool) -> None:
        """Records one step from the current observation; writes what is complete."""
        if self._observation is None:
            raise RuntimeError("NStepAdder.add before start(): begin each episode with start(observation).")
        self._steps.append((self._observation, np.asarray(action, np.float32), float(reward), float(discount)))
        self._observation = np.asarray(next_observation, np.float32)
        if len(self._steps) == self.n_step:
            self._write()
        if last:
            while self._steps:
                self._write()
            self._observation = None

    # -- state for checkpoints ---------------------------------------------------------

    def state(self) -> Dict[str, np.ndarray]:
        """The episode in progress: its current observation (`open`: whether there is one)
        and its steps whose transitions are not written yet (at most n - 1), as arrays."""
        steps = list(self._steps)
        observation = self._observation if self._observation is not None else np.zeros(0, np.float32)
        action = np.stack([a for _, a, _, _ in steps]) if steps else np.zeros((0, 0), np.float32)
        return {"open": np.array(self._observation is not None),
                "observation": observation,
                "pending_observation": (np.stack([o for o, _, _, _ in steps]) if steps
                                        else np.zeros((0,) + observation.shape, np.float32)),
                "pending_action": action,
                "pending_reward": np.array([r for _, _, r, _ in steps], np.float64),
                "pending_discount": np.array([d for _, _, _, d in steps], np.float64)}

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Loads what `state()` returned: the next `add` continues that episode."""
        self._steps.clear()
        for observation, action, reward, discount in zip(
                state["pending_observation"], state["pending_action"], state["pending_reward"],
                state["pending_discount"], strict=True):
            self._steps.append((np.asarray(observation, np.float32), np.asarray(action, np.float32), float(reward),
                                float(discount)))
        self._observation = np.asarray(state["observation"], np.float32) if bool(state["open"]) else None

    def _write(self) -> None:
        """Writes the transition of the oldest pending step, which ends at the current observation."""
        reward, scale = 0.0, 1.0
        for _, _, r, d in self._steps:
            reward += scale * r
            scale *= self.discount * d
        observation, action, _, _ = self._steps.popleft()
        self._replay.add(observation=observation, action=action, reward=np.float32(reward),
                         discount=np.float32(scale), next_observation=self._observation)
