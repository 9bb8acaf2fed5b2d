"""setuptools hook (the project is described in pyproject.toml): ships the gin files of
`experiments/` inside the package, as `expframe/experiments/`, so that a
`pip install .` (not editable) can run a shipped experiment by name
(`expframe --gin_file=quickstart`). `experiments/` stays at the repository root,
where a clone or an editable install reads it (see expframe/gin_paths.py).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def copy_experiments(source_root: str, package_dir: str) -> list:
    """Copies every .gin file under `source_root`/experiments into `package_dir`/experiments;
    returns the copied paths, relative to `package_dir`."""
    copied = []
    source = os.path.join(source_root, "experiments")
    for folder, _, files in os.walk(source):
        for name in sorted(files):
            if not name.endswith(".gin"):
                continue
            relative = os.path.join("experiments", os.path.relpath(os.path.join(folder, name), source))
            target = os.path.join(package_dir, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(folder, name), target)
            copied.append(relative)
    return copied


class BuildPyWithExperiments(build_py):
    """build_py, plus experiments/**/*.gin as package data of `expframe` (not in an
    editable install, which reads the clone's experiments/)."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            copy_experiments(ROOT, os.path.join(self.build_lib, "expframe"))


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPyWithExperiments})
