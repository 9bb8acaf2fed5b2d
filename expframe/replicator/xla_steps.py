"""What `Replicator.jit_compile` does to the steps `Replicator.run_steps` runs.

The per-replica step is wrapped in `tf.function(jit_compile=True)` and called inside
the replicated host loop, so XLA compiles one replica's step (forward, backward,
the optimizer's update) and the strategy keeps its own cross-replica work. Which
targets can (and for 'auto', should) is decided in `auto_settings.py`; the guards
here cover what only the step itself shows:
  * a step marked as not compilable (`exclude`: it calls the host) runs uncompiled,
    and with `jit_compile=True` that is a ConfigError before anything runs;
  * with 'auto', a step that cannot be traced for XLA (traced first, nothing run)
    runs uncompiled, with a line saying so;
  * an XLA failure when the compiled step first runs is a RunError naming the
    binding to change.
"""

from typing import Any, Callable, Union

import tensorflow as tf

from expframe.errors import ConfigError, RunError
from expframe.replicator import auto_settings


def _first_line(error: BaseException) -> str:
    """The error's message in one line (for a tracing error, the user code's error at its end)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return (lines[-1] if lines[0] == "in user code:" else lines[0])[:200]


class XlaSteps:
    """The `jit_compile` binding of one Replicator, checked at construction.

    Args:
      jit_compile: False, True or 'auto'.
      target: the Replicator's target.
      local_replicas: replicas of this process (logical devices on 'cpu').
    """

    def __init__(self, jit_compile: Union[bool, str], target: str, local_replicas: int):
        auto_settings.check_jit_compile(jit_compile, target, local_replicas)
        self.jit_compile, self.target, self.local_replicas = jit_compile, target, local_replicas
        self._compiles = None  # 'auto' is decided on first use, under the precision policy then in force
        self._excluded = {}  # step_fn -> why XLA cannot compile it

    @property
    def compiles(self) -> bool:
        if self._compiles is None:
            if self.jit_compile == "auto":
                self._compiles = auto_settings.auto_jit_compile(self.target, self.local_replicas)
            else:  # a TPU compiles every step anyway
                self._compiles = self.jit_compile is True and self.target != "tpu"
        return self._compiles

    def exclude(self, step_fn: Callable[..., Any], reason: str) -> None:
        if self.jit_compile is True and self.target != "tpu":
            raise ConfigError(f"Replicator.jit_compile=True, but {reason}, which XLA cannot compile; "
                              "set Replicator.jit_compile = False (or 'auto').")
        self._excluded[step_fn] = reason

    def replica_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """step_fn, compiled with XLA if `compiles` and the step is not excluded."""
        if self.compiles and step_fn not in self._excluded:
            return tf.function(step_fn, jit_compile=True)
        return step_fn

    def host_loop(self, build: Callable[[Callable[..., Any]], Any], step_fn: Callable[..., Any], *args) -> Any:
        """`build(replica_step)` -> the host call's tf.function, for the compiled step if
        it compiles; `args` are the call's arguments, to trace it first under 'auto'.
        The returned function has `compiled` set."""
        loop = build(self.replica_step(step_fn))
        loop.compiled = step_fn not in self._excluded and self.compiles
        if loop.compiled and self.jit_compile == "auto":
            try:
                loop.get_concrete_function(*args)
            except Exception as e:  # pylint: disable=broad-except  (any tracing failure: run it as it was)
                print(f"expframe: Replicator.jit_compile='auto': the step cannot be traced for XLA "
                      f"({_first_line(e)}); it runs uncompiled", flush=True)
                self._excluded[step_fn] = "it cannot be traced for XLA"
                loop = build(step_fn)
                loop.compiled = False
        return loop

    @staticmethod
    def call(loop, *args):
        """Calls a host loop; an XLA failure of a compiled one becomes a RunError."""
        try:
            return loop(*args)
        except tf.errors.OpError as e:
            if loop.compiled and any(s in str(e) for s in ("XLA", "xla", "unsupported operations")):
                raise RunError(f"the train step failed under XLA ({_first_line(e)}); set "
                               "Replicator.jit_compile = False") from e
            raise
