"""Headless MuJoCo rendering in a worker process, with a backend that works or a clear error.

Why a process: software OpenGL (Mesa's llvmpipe, what EGL and OSMesa use without a GPU)
loads its own LLVM, and TensorFlow's LLVM in the same process crashes it (a segmentation
fault at the first frame, whichever is loaded first; measured with TF 2.21 and Mesa's
libLLVM-14). So a pixel environment's physics and rendering run in a child process that
never imports TensorFlow (`python -m expframe.rl.rendering --fd=N`), and the learner or
actor process drives it over a socket: an action out, a frame (uint8, 12 KB at 64x64)
back, microseconds beside the ~20 ms of a software-rendered frame.

Backend: `MUJOCO_GL` set to 'egl', 'osmesa' or 'glfw' by the user is the only one tried;
otherwise EGL, then OSMesa, each in a fresh worker (a backend that fails to load can
leave OpenGL half-initialised in the process that tried it). The backend that works is
kept for this process and written into `os.environ["MUJOCO_GL"]`, so processes started
later (actor processes) inherit it. When none renders, `ConfigError` says in one line
what to install or set (exit 2 from main.py).

Lifetime: the worker starts through the process's `expframe.processes.owner()`, in a session
of its own, so a signal to the learner's process group (a terminal's Ctrl-C, `kill -- -PGID`)
does not reach it; it ignores SIGINT itself as well. It stops when told (`close`), when its
owner stops it (SIGTERM), or at end of file on its socket (its parent has gone).

Messages (pickled, `multiprocessing.connection`): ("init", kwargs) -> ("ok", info) |
("config_error", line) | ("render_error", line); ("reset",) -> frame;
("step", action) -> (frame, reward, discount, last); ("reseed", seed) -> None;
("get_state",) -> the task's `state()` arrays; ("set_state", arrays) -> None | one line why
not (`ControlSuiteEnvironment.restore`'s ValueError); ("close",).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Dict, Optional, Tuple

from expframe import processes
from expframe.errors import ConfigError, RunError

BACKENDS = ("egl", "osmesa")
SETUP_HINT = ("install an OpenGL library for headless rendering (Debian/Ubuntu: `apt-get install libegl1 "
              "libgl1-mesa-dri` for EGL, or `libosmesa6` for OSMesa) and set MUJOCO_GL=egl or MUJOCO_GL=osmesa")

_chosen: Optional[str] = None


class RenderWorker:
    """A child process that owns one Control Suite task and renders its frames.

    Args:
      backend: the value of MUJOCO_GL in the child.
      **kwargs: `name`, `action_repeat`, `seed`, `size`, `camera` of the task.
    """

    def __init__(self, backend: str, **kwargs):
        parent, child = socket.socketpair()
        env = dict(os.environ, MUJOCO_GL=backend)
        env.pop("PYOPENGL_PLATFORM", None)
        # Its own session (a signal to our group does not reach it); its output stays on our stderr.
        try:
            self.child = processes.owner().start(
                [sys.executable, "-m", "expframe.rl.rendering", f"--fd={child.fileno()}"],
                name=f"render worker ({kwargs.get('name', 'control_suite')})", env=env,
                pass_fds=[child.fileno()], capture=False, forward=False)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self.status, self.info = self._call(("init", kwargs), starting=True)

    @property
    def pid(self) -> int:
        return self.child.pid

    def _call(self, message: Tuple, starting: bool = False):
        failed = self._send(message, starting)
        return failed if failed is not None else self._receive(starting)

    def _send(self, message: Tuple, starting: bool = False):
        try:
            self._conn.send(message)
        except OSError as error:
            return self._failed(error, starting)
        return None

    def _receive(self, starting: bool = False):
        try:
            return self._conn.recv()
        except (EOFError, OSError) as error:
            return self._failed(error, starting)

    def _failed(self, error: BaseException, starting: bool):
        """The worker has gone: ("render_error", why) while starting; RunError later."""
        status = processes.describe_status(self.child.wait())
        if starting:
            return "render_error", f"the render worker {status} ({type(error).__name__})"
        raise RunError(f"control_suite: the render worker (pid {self.child.pid}) {status}; stopping.") from error

    def reset(self):
        return self._call(("reset",))

    def step(self, action):
        return self._call(("step", action))

    def step_async(self, action) -> None:
        """Sends a step; `step_wait` returns its result. Several workers started this way
        render at the same time (one actor process stepping several environments)."""
        self._send(("step", action))

    def step_wait(self):
        return self._receive()

    def reseed(self, seed: int) -> None:
        self._call(("reseed", int(seed)))

    def get_state(self) -> Dict[str, Any]:
        """The task's state (`ControlSuiteEnvironment.state`: physics, model changes, random
        state, step in the episode), numpy arrays."""
        return self._call(("get_state",))

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restores `get_state()`'s arrays in the worker.

        Raises:
          ValueError: they are another task's (the worker's one line).
        """
        error = self._call(("set_state", dict(state)))
        if error is not None:
            raise ValueError(error)

    def __del__(self):
        # Closing our end of the socket is enough: the worker stops at end of file.
        conn = getattr(self, "_conn", None)
        if conn is not None and not conn.closed:
            conn.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the worker to stop and waits for it (SIGTERM, then SIGKILL, after `timeout_s`)."""
        if self._conn.closed:
            return
        if self.child.alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
        self._conn.close()   # end of file for a worker that is busy, or did not read the message
        owner = processes.owner()
        try:
            self.child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            owner.stop([self.child], signal.SIGTERM, grace_s=3.0)
            return
        owner.reap(self.child)


def start_worker(**kwargs) -> RenderWorker:
    """A running `RenderWorker` on a backend that renders (module docstring).

    Raises:
      ConfigError: a bad task setting (from the worker), or no backend renders.
    """
    global _chosen
    requested = os.environ.get("MUJOCO_GL", "").strip().lower()
    if _chosen is not None:
        candidates = [_chosen]
    elif requested in BACKENDS + ("glfw",):
        candidates = [requested]
    else:
        candidates = list(BACKENDS)
    failures = {}
    for backend in candidates:
        worker = RenderWorker(backend, **kwargs)
        if worker.status == "ok":
            _chosen = os.environ["MUJOCO_GL"] = backend
            return worker
        worker.close()
        if worker.status == "config_error":
            raise ConfigError(worker.info)
        failures[backend] = worker.info
    tried = "; ".join(f"MUJOCO_GL={b}: {why}" for b, why in failures.items())
    unset = " (or unset MUJOCO_GL to try egl, then osmesa)" if requested in candidates else ""
    raise ConfigError(f"control_suite.pixels=True needs headless rendering and none works here ({tried}): "
                      f"{SETUP_HINT}{unset}.")


# -- the worker (no TensorFlow in this process) ----------------------------------------


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or [""]
    return f"{type(error).__name__}: {lines[-1]}".rstrip(": ")


def _open(name: str, action_repeat: int, seed: int, size: int, camera: int) -> Tuple[Any, Dict[str, Any]]:
    """The task and its description; its first frame proves the renderer works."""
    # dm_control picks its OpenGL backend from MUJOCO_GL when first imported: import it
    # here, before expframe's state-feature path would import it without one.
    from dm_control import suite  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

    from expframe.rl.suite_environment import ControlSuiteEnvironment  # pylint: disable=import-outside-toplevel
    env = ControlSuiteEnvironment(name, action_repeat, seed)
    cameras = env._env.physics.model.ncam  # pylint: disable=protected-access
    if not 0 <= camera < cameras:
        raise ConfigError(f"control_suite.camera={camera!r}: {env.name} has {cameras} camera(s), "
                          f"ids 0 to {cameras - 1}.")
    render = lambda: env._env.physics.render(size, size, camera_id=camera)  # noqa: E731  # pylint: disable=protected-access
    env.reset()
    render()
    return (env, render), {"name": env.name, "action_size": env.action_size,
                           "backend": os.environ.get("MUJOCO_GL")}


def serve(conn: Connection) -> None:
    """The worker's loop: answers the messages of the module docstring until told to close."""
    try:
        _, kwargs = conn.recv()
    except (EOFError, OSError):   # the parent went before asking anything
        return
    try:
        (env, render), info = _open(**kwargs)
    except ConfigError as error:
        conn.send(("config_error", str(error).splitlines()[0]))
        return
    except Exception as error:  # pylint: disable=broad-except  # any loader or GL error: this backend cannot render
        conn.send(("render_error", _last_line(error)))
        return
    conn.send(("ok", info))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):   # the parent has gone (closed its end, or died with a frame unread)
            return
        if message[0] == "reset":
            env.reset()
            conn.send(render())
        elif message[0] == "step":
            _, reward, discount, last = env.step(message[1])
            conn.send((render(), reward, discount, last))
        elif message[0] == "reseed":
            env.reseed(message[1])
            conn.send(None)
        elif message[0] == "get_state":
            conn.send(env.state())
        elif message[0] == "set_state":
            try:
                env.restore(message[1])
            except ValueError as error:
                conn.send(str(error).splitlines()[0])
            else:
                conn.send(None)
        else:
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Renders a Control Suite task for a parent process.")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the parent")
    args = parser.parse_args(argv)
    # The terminal's Ctrl-C is the parent's to handle: it closes this worker when its run
    # has saved what it needs (end of file on the socket, or SIGTERM from its owner).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(args.fd)
    try:
        serve(conn)
    except (BrokenPipeError, ConnectionResetError):   # the parent has gone while a frame was on its way
        pass
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
