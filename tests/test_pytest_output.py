"""The test command's own output (issue 31): pytest's summary is the last line it prints.

TensorFlow's start-up notices (`failed call to cuInit`) came after the summary: the
xdist controller imported TensorFlow while loading tests/conftest.py, under pytest's
capture of fd 2, and pytest wrote what it had captured out as the process exited.
"""

import os
import re
import subprocess
import sys

from expframe import tf_noise
from tests import main_runner as mr

SUMMARY = re.compile(r"^=*\s*\d+ passed(, \d+ \w+)* in [\d.]+s( \(\d+:\d\d:\d\d\))?\s*=*$")


def test_the_summary_is_the_last_line_the_test_command_prints():
    """`python -m pytest` as the README gives it (xdist on, from pyproject's addopts),
    with one worker, on a file that never imports TensorFlow itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TF_CPP_"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "tests/test_chrono.py"], cwd=mr.ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                          check=False)  # one stream, in the order a terminal shows it
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, "\n".join(lines[-30:])
    assert SUMMARY.match(lines[-1]), "\n".join(lines[-10:])
    assert [line for line in lines if tf_noise.is_noise(line)] == [], "\n".join(lines)
