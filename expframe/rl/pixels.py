"""Control Suite tasks observed through rendered frames, stacked (`control_suite.pixels = True`).

    env = control_suite(name="cartpole/swingup", action_repeat=8, pixels=True, size=64, frame_stack=3)
    observation = env.reset()                  # uint8 [64, 64, 9]: 3 RGB frames, oldest first
    observation, reward, discount, last = env.step(np.zeros(env.action_size))

Each `step` applies the action `action_repeat` times (as the state-feature environment
does) and then renders one frame from `camera`: one frame per environment step. The
observation is the last `frame_stack` frames concatenated along the channel axis,
oldest first; at `reset` the first frame fills the whole stack (as DrQ's FrameStack,
github.com/denisyarats/drq utils.py). `frame` is the newest frame alone, which is what
the frame replay (`expframe/rl/frame_replay.py`) stores. Frames are uint8; networks
scale them to [0, 1].

The task itself (physics and rendering) lives in a render worker process, because
software OpenGL and TensorFlow cannot share a process (`expframe/rl/rendering.py`, which
also picks the headless backend: EGL, else OSMesa, else a one-line ConfigError saying
what to install or set). Call `close()` (or let the process exit) to stop the worker.
"""

import collections
from typing import Dict, Tuple

import numpy as np

from expframe.errors import ConfigError
from expframe.rl.rendering import start_worker


def _integer(binding: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"control_suite.{binding}={value!r} must be an integer >= {minimum}.")
    return value


class PixelControlSuiteEnvironment:
    """A Control Suite task whose observations are stacks of rendered RGB frames.

    Args:
      name: 'domain/task'.
      action_repeat: control steps per `step()` call, the same action each time.
      seed: seeds the task's random initial states.
      size: frames are `size` x `size` pixels.
      camera: the MuJoCo camera rendered.
      frame_stack: frames per observation.
    """

    def __init__(self, name: str, action_repeat: int = 1, seed: int = 0, size: int = 64, camera: int = 0,
                 frame_stack: int = 3):
        self.size = _integer("size", size, minimum=8)
        self.frame_stack = _integer("frame_stack", frame_stack, minimum=1)
        _integer("action_repeat", action_repeat, minimum=1)
        self._worker = start_worker(name=name, action_repeat=action_repeat, seed=int(seed), size=self.size,
                                    camera=_integer("camera", camera, minimum=0))
        self.name, self.action_size = self._worker.info["name"], self._worker.info["action_size"]
        self.backend, self.action_repeat, self.camera = self._worker.info["backend"], action_repeat, camera
        self.frame_shape: Tuple[int, int, int] = (self.size, self.size, 3)
        self.observation_shape = (self.size, self.size, 3 * self.frame_stack)
        self.observation_dtype = np.uint8
        self.observation_size = int(np.prod(self.observation_shape))
        self._frames = collections.deque(maxlen=self.frame_stack)
        self._last = True

    @property
    def frame(self) -> np.ndarray:
        """The newest frame of the current observation, uint8 [size, size, 3]."""
        return self._frames[-1]

    def _stack(self) -> np.ndarray:
        return np.concatenate(self._frames, axis=-1)

    def reset(self) -> np.ndarray:
        """Starts an episode; its first frame fills the stack."""
        frame = self._worker.reset()
        for _ in range(self.frame_stack):
            self._frames.append(frame)
        self._last = False
        return self._stack()

    def step(self, action: np.ndarray) -> Tuple[np.ndarray, float, float, bool]:
        """Applies `action` (in [-1, 1]) `action_repeat` times, then renders one frame.

        Returns:
          (stacked frames, summed reward, product of discounts, whether the episode ended).
        """
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: np.ndarray) -> None:
        """`step` in two halves: this sends the action to the render worker and returns at
        once; `step_wait` returns what `step` would. Environments stepped this way, each
        with its own worker, render at the same time (`expframe.rl.actors.run_together`)."""
        if self._last:
            raise RuntimeError("PixelControlSuiteEnvironment.step after the episode ended; call reset() first.")
        self._worker.step_async(np.asarray(action, np.float64).reshape(-1))

    def step_wait(self) -> Tuple[np.ndarray, float, float, bool]:
        frame, reward, discount, self._last = self._worker.step_wait()
        self._frames.append(frame)
        return self._stack(), reward, discount, self._last

    def reseed(self, seed: int) -> None:
        """Reseeds the task's random initial states (each evaluation does); the next reset uses it."""
        self._worker.reseed(seed)
        self._last = True

    def state(self) -> Dict[str, np.ndarray]:
        """The task's state from the render worker (`ControlSuiteEnvironment.state`) and
        `frames`, the current stack (uint8 [k, size, size, 3], oldest first; none between
        episodes): what the next steps depend on (for a checkpoint; `restore`)."""
        out = dict(self._worker.get_state())
        out["frames"] = (np.stack(self._frames) if self._frames
                         else np.zeros((0,) + self.frame_shape, np.uint8))
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Loads what `state()` returned: the render worker's task and the frame stack.

        Raises:
          ValueError: the state is another task's or frame size's.
        """
        frames = np.asarray(state["frames"])
        if frames.shape[1:] != self.frame_shape or len(frames) not in (0, self.frame_stack):
            raise ValueError(f"the saved frame stack has shape {frames.shape}, this environment's "
                             f"({self.frame_stack},) + {self.frame_shape} (another frame size or stack?).")
        self._worker.set_state({k: v for k, v in state.items() if k != "frames"})
        self._frames.clear()
        self._frames.extend(frames.astype(np.uint8))
        self._last = bool(state["counters"][2])

    def close(self) -> None:
        """Stops the render worker."""
        self._worker.close()
