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

Rendering is headless (EGL, else OSMesa: `expframe/rl/rendering.py`); a machine where
no backend works gets a one-line ConfigError saying what to install or set.
"""

import collections
from typing import Tuple

import numpy as np

from expframe.errors import ConfigError
from expframe.rl.environments import ControlSuiteEnvironment
from expframe.rl.rendering import ensure_renderer


def _positive_int(binding: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"control_suite.{binding}={value!r} must be an integer >= {minimum}.")
    return value


class PixelControlSuiteEnvironment(ControlSuiteEnvironment):
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
        self.size = _positive_int("size", size, minimum=8)
        self.camera = _positive_int("camera", camera, minimum=0)
        self.frame_stack = _positive_int("frame_stack", frame_stack)
        self.backend = ensure_renderer()
        super().__init__(name, action_repeat, seed)
        cameras = self._env.physics.model.ncam
        if self.camera >= cameras:
            raise ConfigError(f"control_suite.camera={camera!r}: {self.name} has {cameras} camera(s), "
                              f"ids 0 to {cameras - 1}.")
        self.frame_shape: Tuple[int, int, int] = (self.size, self.size, 3)
        self.observation_shape = (self.size, self.size, 3 * self.frame_stack)
        self.observation_dtype = np.uint8
        self.observation_size = int(np.prod(self.observation_shape))
        self._frames = collections.deque(maxlen=self.frame_stack)

    def render(self) -> np.ndarray:
        """The current frame, uint8 [size, size, 3]."""
        return self._env.physics.render(self.size, self.size, camera_id=self.camera)

    @property
    def frame(self) -> np.ndarray:
        """The newest frame of the current observation."""
        return self._frames[-1]

    def _stack(self) -> np.ndarray:
        return np.concatenate(self._frames, axis=-1)

    def reset(self) -> np.ndarray:
        """Starts an episode; its first frame fills the stack."""
        super().reset()
        frame = self.render()
        for _ in range(self.frame_stack):
            self._frames.append(frame)
        return self._stack()

    def step(self, action: np.ndarray) -> Tuple[np.ndarray, float, float, bool]:
        """Applies `action` `action_repeat` times, then renders one frame.

        Returns:
          (stacked frames, summed reward, product of discounts, whether the episode ended).
        """
        _, reward, discount, last = super().step(action)
        self._frames.append(self.render())
        return self._stack(), reward, discount, last
