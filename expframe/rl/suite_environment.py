"""One DeepMind Control Suite task with flat state observations and actions in [-1, 1].

    env = ControlSuiteEnvironment("cartpole/balance", action_repeat=1, seed=0)
    observation = env.reset()                                   # float32 [observation_size]
    observation, reward, discount, last = env.step(np.zeros(env.action_size))

Observations are the suite's state features (no rendering), concatenated in the order
of the observation spec and cast to float32. Actions are taken in [-1, 1] per dimension
and rescaled to the task's own bounds, so a tanh policy fits every task. With
`action_repeat = k` one step applies the action k times, sums the rewards and
multiplies the discounts, stopping early at the episode's end.

An episode of a Control Suite task ends by its time limit (1000 control steps for
most tasks) with discount 1: a truncation, whose last state still has a value. A
task whose episode ends in a terminal state reports discount 0 there.

This module imports neither gin nor the renderer: the gin-configurable `control_suite`
(`expframe/rl/environments.py`) builds it or its pixel variant (`expframe/rl/pixels.py`),
and the render worker (`expframe/rl/rendering.py`) drives one in its own process.
"""

import os
import sys
from typing import Tuple

import numpy as np

from expframe.errors import ConfigError


def _suite():
    """dm_control's suite, imported on first use (1 s): runs that never act never pay it."""
    # State observations need no renderer. dm_control picks its OpenGL backend from
    # MUJOCO_GL when first imported: without one it tries GLFW (warnings on a machine
    # without a display), and a software renderer cannot live beside TensorFlow in one
    # process at all (`expframe/rl/rendering.py`), so import it with rendering off and
    # leave MUJOCO_GL as it was (the render worker imports dm_control first, its own way).
    if "dm_control.suite" not in sys.modules:
        previous = os.environ.get("MUJOCO_GL")
        os.environ["MUJOCO_GL"] = "disable"
        try:
            import dm_control.suite  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
        finally:
            if previous is None:
                os.environ.pop("MUJOCO_GL", None)
            else:
                os.environ["MUJOCO_GL"] = previous
    from dm_control import suite  # pylint: disable=import-outside-toplevel
    return suite


def _split_name(name: str) -> Tuple[str, str]:
    """'domain/task' -> (domain, task); ConfigError listing the valid names otherwise."""
    suite = _suite()
    domain, _, task = str(name).partition("/")
    domains = suite._DOMAINS  # pylint: disable=protected-access
    if domain not in domains:
        benchmark = ", ".join(f"{d}/{t}" for d, t in suite.BENCHMARKING)
        raise ConfigError(f"control_suite.name={name!r}: unknown domain {domain!r}; use 'domain/task' with "
                          f"a domain of {', '.join(sorted(domains))} (the benchmark tasks: {benchmark}).")
    tasks = sorted(domains[domain].SUITE)
    if task not in tasks:
        raise ConfigError(f"control_suite.name={name!r}: domain {domain!r} has no task {task!r}; "
                          f"use one of {', '.join(f'{domain}/{t}' for t in tasks)}.")
    return domain, task


class ControlSuiteEnvironment:
    """One Control Suite task: flat float32 observations, actions in [-1, 1].

    Args:
      name: 'domain/task', e.g. 'cartpole/balance' (see `dm_control.suite.BENCHMARKING`).
      action_repeat: control steps per `step()` call, the same action each time.
      seed: seeds the task's random initial states.
    """

    def __init__(self, name: str, action_repeat: int = 1, seed: int = 0):
        domain, task = _split_name(name)
        if isinstance(action_repeat, bool) or not isinstance(action_repeat, int) or action_repeat < 1:
            raise ConfigError(f"control_suite.action_repeat={action_repeat!r} must be a positive integer.")
        self.name = f"{domain}/{task}"
        self.action_repeat = action_repeat
        self._env = _suite().load(domain, task, task_kwargs={"random": int(seed)})
        spec = self._env.action_spec()
        self._low = np.asarray(spec.minimum, np.float64)
        self._high = np.asarray(spec.maximum, np.float64)
        self.action_size = int(np.prod(spec.shape))
        self.observation_size = int(sum(np.prod(s.shape) for s in self._env.observation_spec().values()))
        self.observation_shape, self.observation_dtype = (self.observation_size,), np.float32
        self._last = True

    def reseed(self, seed: int) -> None:
        """Reseeds the task's random initial states (e.g. on resume); the next reset uses it."""
        self._env.task.random.seed(int(seed) % 2**32)
        self._last = True

    @staticmethod
    def _flatten(observation) -> np.ndarray:
        return np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in observation.values()])

    def reset(self) -> np.ndarray:
        """Starts an episode; returns its first observation."""
        self._last = False
        return self._flatten(self._env.reset().observation)

    def step(self, action: np.ndarray) -> Tuple[np.ndarray, float, float, bool]:
        """Applies `action` (in [-1, 1]) `action_repeat` times.

        Returns:
          (next observation, summed reward, product of discounts, whether the episode ended).
        """
        if self._last:
            raise RuntimeError("ControlSuiteEnvironment.step after the episode ended; call reset() first.")
        action = np.clip(np.asarray(action, np.float64).reshape(-1), -1.0, 1.0)
        scaled = self._low + (action + 1.0) * 0.5 * (self._high - self._low)
        reward, discount = 0.0, 1.0
        for _ in range(self.action_repeat):
            timestep = self._env.step(scaled)
            reward += float(timestep.reward or 0.0)
            discount *= float(1.0 if timestep.discount is None else timestep.discount)
            if timestep.last():
                self._last = True
                break
        return self._flatten(timestep.observation), reward, discount, self._last
