"""`control_suite`, the gin-configurable DeepMind Control Suite task: state features
(`ControlSuiteEnvironment`, `expframe/rl/suite_environment.py`) or rendered frames
(`pixels=True`: `expframe/rl/pixels.py`), actions in [-1, 1].

    env = control_suite(name="cartpole/balance", seed=0)
    observation = env.reset()                                   # float32 [observation_size]
    observation, reward, discount, last = env.step(np.zeros(env.action_size))

Imports run one way: this module -> pixels -> rendering -> suite_environment, and this
module -> suite_environment (the render worker needs the state-feature task, not the
gin factory).
"""

import gin

from expframe.rl.suite_environment import ControlSuiteEnvironment

__all__ = ["ControlSuiteEnvironment", "control_suite"]


@gin.configurable
def control_suite(name: str = "cartpole/balance", action_repeat: int = 1, seed: int = 0, pixels: bool = False,
                  size: int = 64, camera: int = 0, frame_stack: int = 3) -> ControlSuiteEnvironment:
    """A Control Suite task by name (gin: `control_suite.name = 'walker/walk'`).

    Args:
      name: 'domain/task'; an unknown one is a ConfigError listing the valid names.
      action_repeat: control steps per environment step.
      seed: given by the caller (the task seeds its acting and eval environments apart).
      pixels: observe rendered frames instead of state features (needs a headless
        renderer: `expframe/rl/rendering.py`); the next three apply to pixels only.
      size: frames are size x size RGB pixels.
      camera: the MuJoCo camera id rendered (0 for most tasks; 2 for quadruped).
      frame_stack: frames per observation, stacked along the channels, oldest first.
    """
    if pixels:
        from expframe.rl.pixels import PixelControlSuiteEnvironment  # pylint: disable=import-outside-toplevel
        return PixelControlSuiteEnvironment(name, action_repeat, seed, size=size, camera=camera,
                                            frame_stack=frame_stack)
    return ControlSuiteEnvironment(name, action_repeat, seed)
