"""Errors that reach the user, and the exit codes they map to (see DESIGN.md, CLI)."""


class ConfigError(ValueError):
    """A configuration the run cannot start with: bad binding, value, file or data.

    The message is one line that names what was wrong (file, binding or value) and
    what to do. `main.py` prints it and exits with status 2, before anything is
    written into the model_dir.
    """

    exit_code = 2


class RunError(RuntimeError):
    """A failure during the run (NaN loss, lost worker). Exit status 1.

    The last good checkpoint in the model_dir is left intact.
    """

    exit_code = 1


class WorkerLostError(RunError):
    """A worker of a multi-process cluster died or stopped answering (the coordination
    service's heartbeats, a failed collective). Exit status 1; the last good checkpoint
    is intact, and `python -m expframe.launch --max_restarts=N` restarts the cluster.
    """
