"""Headless MuJoCo rendering for pixel observations: pick a backend that works, or say what to install.

MuJoCo renders through an OpenGL context; dm_control picks its backend from the
`MUJOCO_GL` environment variable once, when `dm_control` is first imported. Without a
display the choices are EGL (a GPU driver's EGL, or Mesa's software EGL) and OSMesa.

`ensure_renderer()` makes this process render, once:
  * `MUJOCO_GL` set to 'egl', 'osmesa' or 'glfw' by the user: that backend, nothing else;
  * otherwise EGL, else OSMesa, each first tried in a short subprocess (a backend that
    fails to load can leave OpenGL half-initialised in the process that tried it).
The backend found is written into `os.environ["MUJOCO_GL"]`, so processes started
afterwards (actor processes) inherit it and skip the search. When none renders, it
raises `ConfigError` with one line naming what to install or set (exit 2 from main.py).

State-feature environments import dm_control with `MUJOCO_GL=disable` (no OpenGL at all);
if that happened first in this process, the backend is switched in place here: dm_control
reads `dm_control._render.Renderer` each time a physics makes its rendering context.
"""

import os
import subprocess
import sys
from typing import Optional

from expframe.errors import ConfigError

BACKENDS = ("egl", "osmesa")
_SETUP_HINT = ("install an OpenGL backend for headless MuJoCo rendering (Debian/Ubuntu: "
               "`apt-get install libegl1 libgl1-mesa-dri` for EGL, or `libosmesa6` for OSMesa) "
               "and set MUJOCO_GL=egl or MUJOCO_GL=osmesa")
# One frame from a tiny model: enough to load the backend and draw.
_PROBE = ("import numpy as np\n"
          "from dm_control import mujoco\n"
          "physics = mujoco.Physics.from_xml_string('<mujoco><worldbody><geom size=\"1\"/></worldbody></mujoco>')\n"
          "frame = physics.render(8, 8)\n"
          "assert frame.shape == (8, 8, 3) and frame.dtype == np.uint8\n")

_chosen: Optional[str] = None


def _probe_in_subprocess(backend: str, timeout_s: float = 120.0) -> Optional[str]:
    """None if `backend` renders a frame in a fresh interpreter, else the last error line."""
    env = dict(os.environ, MUJOCO_GL=backend)
    env.pop("PYOPENGL_PLATFORM", None)
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"no frame within {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def _activate(backend: str) -> None:
    """Makes dm_control in this process render with `backend` and draws one frame."""
    already = "dm_control._render" in sys.modules
    os.environ["MUJOCO_GL"] = backend
    from dm_control import _render, mujoco  # pylint: disable=import-outside-toplevel
    if already and _render.BACKEND != backend:
        # Imported earlier with another backend (state features import it as 'disable').
        importers = {"egl": "_import_egl", "osmesa": "_import_osmesa", "glfw": "_import_glfw"}
        importer = getattr(_render, importers[backend], None)
        if importer is None or not hasattr(_render, "Renderer"):
            raise ConfigError(f"MUJOCO_GL={backend}: dm_control was imported before with "
                              f"MUJOCO_GL={_render.BACKEND} and this dm_control version cannot switch; "
                              f"set MUJOCO_GL={backend} before starting Python.")
        if backend == "egl":
            os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
        _render.Renderer = importer()
        _render.BACKEND = backend
    physics = mujoco.Physics.from_xml_string('<mujoco><worldbody><geom size="1"/></worldbody></mujoco>')
    physics.render(8, 8)


def ensure_renderer() -> str:
    """Makes MuJoCo render headless in this process (see module docstring); returns the backend.

    Raises:
      ConfigError: no backend renders, with one line saying what to install or set.
    """
    global _chosen
    if _chosen is not None:
        return _chosen
    requested = os.environ.get("MUJOCO_GL", "").strip().lower()
    if requested in BACKENDS + ("glfw",):
        candidates, failures = [requested], {}
    else:
        candidates, failures = [], {}
        for backend in BACKENDS:
            failure = _probe_in_subprocess(backend)
            if failure is None:
                candidates = [backend]
                break
            failures[backend] = failure
    for backend in candidates:
        try:
            _activate(backend)
        except ConfigError:
            raise
        except Exception as error:  # pylint: disable=broad-except  # any loader or GL error means: cannot render
            lines = str(error).strip().splitlines() or [""]
            failures[backend] = f"{type(error).__name__}: {lines[-1]}"
            continue
        _chosen = backend
        return backend
    tried = "; ".join(f"MUJOCO_GL={b}: {why}" for b, why in failures.items())
    raise ConfigError(f"control_suite.pixels=True needs a headless renderer and none works here ({tried}): "
                      f"{_SETUP_HINT}.")
