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

`state()` and `restore(state)` carry everything the next steps depend on (the physics,
the model values the task set for the episode, the task's random state, the step within
the episode), so a restored environment steps as the original would, to the bit.

This module imports neither gin nor the renderer: the gin-configurable `control_suite`
(`expframe/rl/environments.py`) builds it or its pixel variant (`expframe/rl/pixels.py`),
and the render worker (`expframe/rl/rendering.py`) drives one in its own process.
"""

import os
import sys
from typing import Dict, Tuple

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


def _integration_state() -> int:
    """mjSTATE_INTEGRATION: everything `mj_step` reads from mjData (MuJoCo >= 3.0)."""
    import mujoco  # pylint: disable=import-outside-toplevel
    return int(mujoco.mjtState.mjSTATE_INTEGRATION)


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


# Model arrays larger than this (textures, meshes) are not compared or saved by `state()`:
# no suite task changes them per episode, and copying them would cost megabytes per environment.
_MODEL_ARRAY_LIMIT_BYTES = 1 << 20


def _model_arrays(model) -> Dict[str, np.ndarray]:
    """Copies of a MuJoCo model's numeric arrays up to `_MODEL_ARRAY_LIMIT_BYTES` each, by name."""
    out = {}
    for name in dir(model):
        if name.startswith("_"):
            continue
        try:
            value = getattr(model, name)
        except Exception:  # noqa: BLE001  (an attribute the bindings cannot read: not state)
            continue
        numeric = isinstance(value, np.ndarray) and value.dtype.kind in "biuf"
        if numeric and 0 < value.nbytes <= _MODEL_ARRAY_LIMIT_BYTES:
            out[name] = value.copy()
    return out


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
        # The model as loaded, before any episode changed it (a reacher's target, a quadruped's terrain).
        self._built_model = _model_arrays(self._env.physics.model.ptr)

    def reseed(self, seed: int) -> None:
        """Reseeds the task's random initial states (each evaluation does); the next reset uses it."""
        self._env.task.random.seed(int(seed) % 2**32)
        self._last = True

    def state(self) -> Dict[str, np.ndarray]:
        """What the next steps depend on, as numpy arrays (for a checkpoint; `restore`):

          physics          MuJoCo's integration state (`mj_getState`, mjSTATE_INTEGRATION:
                           time, positions, velocities, actuator activations, controls,
                           applied forces, mocap poses and the solver's warm start);
          model/NAME       each model array the task changed since it was loaded (it sets
                           some per episode: a reacher's target, a quadruped's terrain);
          random_*         the task's random state (the next episodes' initial states);
          counters         [control steps into the episode, episode over (reset next),
                           episode over (this wrapper's)].
        """
        physics = self._env.physics
        out = {"physics": physics.get_state(sig=_integration_state())}
        model = physics.model.ptr
        for name, built in self._built_model.items():
            value = getattr(model, name)
            if value.tobytes() != built.tobytes():
                out[f"model/{name}"] = value.copy()
        _, keys, position, has_gauss, gauss = self._env.task.random.get_state()
        out.update(random_keys=np.asarray(keys, np.uint32), random_position=np.array([position, has_gauss], np.int64),
                   random_gauss=np.array(gauss, np.float64),
                   counters=np.array([self._env._step_count, self._env._reset_next_step, self._last],  # pylint: disable=protected-access
                                     np.int64))
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Loads what `state()` returned (into an environment of the same task): the next
        `step` or `reset` returns what the saved environment's would have.

        Raises:
          ValueError: the state is another task's.
        """
        physics = self._env.physics
        saved = np.asarray(state["physics"], np.float64)
        size = physics.get_state(sig=_integration_state()).shape
        if saved.shape != size:
            raise ValueError(f"the saved {self.name} physics state has {saved.shape[0]} numbers, this "
                             f"environment's {size[0]} (another task?).")
        model, uploaded = physics.model.ptr, False
        for name, built in self._built_model.items():
            target = np.asarray(state.get(f"model/{name}", built))
            current = getattr(model, name)
            if target.shape != current.shape:
                raise ValueError(f"the saved {self.name} model array {name} has shape {target.shape}, this "
                                 f"environment's {current.shape} (another task?).")
            if current.tobytes() != target.tobytes():
                np.copyto(current, target)
                uploaded = uploaded or name == "hfield_data"
        if uploaded and physics._contexts:  # pylint: disable=protected-access  # a renderer drew the old terrain
            import mujoco  # pylint: disable=import-outside-toplevel
            with physics.contexts.gl.make_current() as context:
                for hfield in range(model.nhfield):
                    context.call(mujoco.mjr_uploadHField, model, physics.contexts.mujoco.ptr, hfield)
        physics.set_state(saved, sig=_integration_state())
        physics.forward()   # positions, velocities and what follows from them, as after a step
        self._env.task.random.set_state(("MT19937", np.asarray(state["random_keys"], np.uint32),
                                         int(state["random_position"][0]), int(state["random_position"][1]),
                                         float(state["random_gauss"])))
        step_count, reset_next, last = (int(v) for v in state["counters"])
        self._env._step_count, self._env._reset_next_step = step_count, bool(reset_next)  # pylint: disable=protected-access
        self._last = bool(last)

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
