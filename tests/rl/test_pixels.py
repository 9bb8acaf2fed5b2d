"""Pixel observations: frames rendered headless in a worker process (beside TensorFlow), stacked
oldest first, seeded, restored from their state (checkpoints) to the bit; bad settings and a
machine without a working renderer are one-line ConfigErrors naming what to set or install."""

import os
import signal
import time

import numpy as np
import tensorflow as tf

from expframe import processes
from expframe.errors import ConfigError
from expframe.rl import rendering
from expframe.rl.environments import control_suite
from tests.support import TestCase


class PixelEnvironmentTest(TestCase):

    def test_frames_are_rendered_stacked_and_seeded(self):
        tf.constant(1.0) + 1.0   # TensorFlow runs in this process; rendering must not crash it
        env = control_suite(name="cartpole/swingup", action_repeat=4, seed=3, pixels=True, size=32, frame_stack=3)
        try:
            self.assertIn(env.backend, ("egl", "osmesa", "glfw"))
            self.assertEqual(os.environ["MUJOCO_GL"], env.backend)   # actor processes inherit it
            self.assertEqual((env.observation_shape, env.frame_shape, env.action_size), ((32, 32, 9), (32, 32, 3), 1))
            first = env.reset()
            self.assertEqual((first.shape, first.dtype), ((32, 32, 9), np.uint8))
            # The first frame fills the stack; it shows something (not a blank image).
            np.testing.assert_array_equal(first[..., :3], first[..., 6:])
            self.assertGreater(first.std(), 5.0)
            observations = [first]
            for action in (1.0, 1.0, -1.0):
                observation, reward, discount, last = env.step(np.array([action]))
                observations.append(observation)
                self.assertEqual((discount, last), (1.0, False))
                self.assertTrue(0.0 <= reward <= 4.0)
            for before, after in zip(observations[:-1], observations[1:], strict=True):
                np.testing.assert_array_equal(after[..., :6], before[..., 3:])   # shifted by one frame
                self.assertFalse(np.array_equal(after[..., 6:], before[..., 6:]))   # the cart moved
            np.testing.assert_array_equal(env.frame, observations[-1][..., 6:])
            other = control_suite(name="cartpole/swingup", action_repeat=4, seed=4, pixels=True, size=32)
            self.assertFalse(np.array_equal(other.reset(), first))   # another seed, another start
            other.reseed(7)   # as each evaluation does: the next episodes start the same way again
            again = other.reset()
            other.reseed(7)
            np.testing.assert_array_equal(other.reset(), again)
            other.close()
            # The render worker leads a session of its own (a Ctrl-C to this process's group
            # does not reach it), ignores SIGINT itself, and close() leaves nothing running.
            worker = env._worker  # pylint: disable=protected-access
            self.assertEqual(os.getsid(worker.pid), worker.pid)
            self.assertNotEqual(os.getsid(worker.pid), os.getsid(0))
            os.kill(worker.pid, signal.SIGINT)
            time.sleep(0.5)
            self.assertEqual(env.reset().shape, (32, 32, 9))
        finally:
            env.close()
        self.assertFalse(processes.group_alive(worker.pid))
        self.assertFalse(processes.group_alive(other._worker.pid))  # pylint: disable=protected-access

    def test_state_from_the_render_worker_restores_the_episode_to_the_bit(self):
        """The worker's physics, random state and step in the episode, and the frame stack:
        a restored environment (another seed, its own worker) renders what the saved one does,
        through an episode's end and the next episode's start."""
        make = lambda seed: control_suite(name="cartpole/swingup", action_repeat=25, seed=seed, pixels=True,  # noqa: E731
                                          size=16, frame_stack=2)
        saved, restored = make(3), make(8)
        try:
            actions = np.random.default_rng(0).uniform(-1.0, 1.0, (60, 1))
            saved.reset()
            for action in actions[:13]:
                saved.step(action)
            state = saved.state()
            self.assertEqual(state["frames"].shape, (2, 16, 16, 3))
            restored.reset()
            restored.restore(state)
            np.testing.assert_array_equal(restored.frame, saved.frame)
            ends = 0
            for action in actions[13:]:
                expected, got = saved.step(action), restored.step(action)
                for x, y in zip(got, expected, strict=True):
                    np.testing.assert_array_equal(x, y)
                if expected[-1]:   # the episode's 40th step: both start the next one alike
                    ends += 1
                    np.testing.assert_array_equal(restored.reset(), saved.reset())
            self.assertEqual(ends, 1)
            with self.assertRaisesRegex(ValueError, "frame stack"):
                restored.restore(dict(state, frames=state["frames"][:, :8]))
            bad = dict(state, physics=state["physics"][:-1])
            with self.assertRaisesRegex(ValueError, "another task"):
                restored.restore(bad)
        finally:
            saved.close()
            restored.close()

    def test_bad_settings_are_config_errors(self):
        with self.assertRaisesRegex(ConfigError, r"control_suite.camera=5: cartpole/swingup has 2 camera\(s\)"):
            control_suite(name="cartpole/swingup", pixels=True, camera=5)
        with self.assertRaisesRegex(ConfigError, "control_suite.size=4 must be an integer >= 8"):
            control_suite(name="cartpole/swingup", pixels=True, size=4)

    def test_no_working_renderer_is_one_line_naming_what_to_do(self):
        saved = (rendering._chosen, rendering.BACKENDS, os.environ.get("MUJOCO_GL"))  # pylint: disable=protected-access
        os.environ["MUJOCO_EGL_DEVICE_ID"] = "99"   # no such EGL device: EGL fails on any machine
        try:
            rendering._chosen = None  # pylint: disable=protected-access
            os.environ["MUJOCO_GL"] = "egl"           # the user's choice: only it is tried
            with self.assertRaises(ConfigError) as raised:
                control_suite(name="cartpole/swingup", pixels=True)
            # One line (main.py prints it; gin appends the configurable's name on a second).
            message = str(raised.exception).splitlines()[0]
            self.assertIn("MUJOCO_GL=egl: RuntimeError: MUJOCO_EGL_DEVICE_ID must be an integer", message)
            self.assertIn("apt-get install libegl1", message)
            self.assertIn("unset MUJOCO_GL", message)
            # Not set: each backend is tried in turn (here EGL and one that cannot exist).
            os.environ.pop("MUJOCO_GL")
            rendering.BACKENDS = ("egl", "nonexistent")
            with self.assertRaises(ConfigError) as raised:
                control_suite(name="cartpole/swingup", pixels=True)
            message = str(raised.exception).splitlines()[0]
            self.assertRegex(message, r"^control_suite.pixels=True needs headless rendering and none works here "
                                      r"\(MUJOCO_GL=egl: .*; MUJOCO_GL=nonexistent: RuntimeError: .*\): install")
        finally:
            os.environ.pop("MUJOCO_EGL_DEVICE_ID")
            rendering._chosen, rendering.BACKENDS = saved[0], saved[1]  # pylint: disable=protected-access
            if saved[2] is None:
                os.environ.pop("MUJOCO_GL", None)
            else:
                os.environ["MUJOCO_GL"] = saved[2]
