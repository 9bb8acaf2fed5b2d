"""Ctrl-C (SIGINT) before the first training step: stop at once, nothing was trained.

A run spends its first seconds to minutes importing TensorFlow, loading (or
generating) data, building the model and tracing the first step. `arm()`, called
first thing by the command line (`expframe.cli`), makes SIGINT in that time raise
`StartupInterrupt`, which the command line turns into one line and exit status 130.
It installs the handler whatever the parent left (a shell that starts a job in the
background sets SIGINT to "ignore", which is why Ctrl-C used to be ignored until
training began).

Python runs a signal handler only when the main thread runs Python code; a long
call into TensorFlow's C++ (compiling the first step) would delay it. So a watchdog
thread also sees the signal (through `signal.set_wakeup_fd`) and, if the process is
still running `GRACE_S` seconds later, prints the same line and ends it.

From the first finished training step on, the trainer handles SIGINT and SIGTERM
(checkpoint, exit 0): it calls `disarm()`.
"""

import os
import signal
import sys
import threading
import time
from typing import Optional

GRACE_S = 5.0
_armed = False
_wakeup: Optional[int] = None


class StartupInterrupt(BaseException):
    """SIGINT (or SIGTERM) before the first training step. A BaseException, like
    KeyboardInterrupt, so that `except Exception` in library code lets it through."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def message(signum: int) -> str:
    """The one line printed when a run stops before its first step."""
    return (f"expframe: stopped by {signal.Signals(signum).name} during start-up, before the first training "
            "step: nothing was trained (the model_dir's checkpoints are as they were).")


def _handler(signum, frame):  # pylint: disable=unused-argument
    if _armed:
        raise StartupInterrupt(signum)
    raise KeyboardInterrupt  # Python's own behaviour, after disarm()


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if _armed and signal.SIGINT in data:
            signum = signal.SIGINT
            time.sleep(GRACE_S)
            if _armed:  # the main thread did not get to the handler: it is inside a long C++ call
                os.write(2, (message(signum) + f" (forced after {GRACE_S:.0f} s)\n").encode())
                os._exit(128 + signum)  # pylint: disable=protected-access


def arm() -> None:
    """Makes SIGINT stop the process at once until `disarm()` (main thread only)."""
    global _armed, _wakeup
    _armed = True
    signal.signal(signal.SIGINT, _handler)
    if _wakeup is None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the handler alone
            os.close(read_fd)
            os.close(write_fd)
            return
        _wakeup = write_fd
        threading.Thread(target=_watch, args=(read_fd,), name="expframe-sigint", daemon=True).start()


def disarm() -> None:
    """Training has begun: from now on SIGINT is the trainer's (or Python's) to handle."""
    global _armed, _wakeup
    if not _armed:
        return
    _armed = False
    if _wakeup is not None and threading.current_thread() is threading.main_thread():
        signal.set_wakeup_fd(-1)
        os.close(_wakeup)  # the watchdog reads to the end and returns
        _wakeup = None


def is_armed() -> bool:
    return _armed


def report(error: StartupInterrupt) -> int:
    """Prints the one line for `error`; returns the exit status."""
    disarm()
    sys.stderr.write(message(error.signum) + "\n")
    sys.stderr.flush()
    return error.exit_code
