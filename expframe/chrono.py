"""Chrono: training speed that counts training time only (after big_vision's Chrono)."""

import contextlib
import time
from typing import Callable, Iterator


class Chrono:
    """Steps per second over the host calls of train steps, and nothing else.

    Only what runs inside `measure` counts: evaluation, checkpoints and logging
    between host calls do not. Nor does the first host call of the process: it traces
    the step function and optimises its graph (seconds to minutes, once), which says
    nothing about the speed of training. Its rate is used only when an interval holds
    nothing else (a log line right after the first host call), tracing included.

    Example:
      chrono = Chrono()
      with chrono.measure(steps=50):
          run_50_steps()
      steps_per_sec = chrono.lap()
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._warm = False
        self._steps, self._seconds = 0, 0.0  # measured since the last lap
        self._first = None  # (steps, seconds) of the first host call, until a lap passes it

    @contextlib.contextmanager
    def measure(self, steps: int) -> Iterator[None]:
        """Times one host call of `steps` train steps."""
        start = self._clock()
        yield
        seconds = self._clock() - start
        if not self._warm:
            self._warm, self._first = True, (steps, seconds)
        else:
            self._steps += steps
            self._seconds += seconds

    def lap(self) -> float:
        """Steps per second measured since the previous lap (0.0 if nothing ran)."""
        steps, seconds = (self._steps, self._seconds) if self._steps else (self._first or (0, 0.0))
        self._steps, self._seconds, self._first = 0, 0.0, None
        return steps / seconds if seconds > 0 else 0.0
