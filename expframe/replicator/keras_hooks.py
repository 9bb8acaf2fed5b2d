"""Checks, at import, that the private Keras methods expframe overrides still exist.

`wrap_optimizer` turns off Keras' own cross-replica gradient sum by replacing
`_all_reduce_sum_gradients` on its optimizer; `SyncBatchNorm` replaces
`BatchNormalization._moments` and reads `_reduction_axes`. These are private
names: a Keras release that renames them would leave the overrides silently
unused, and then gradients are summed N times over N replicas, or batch norm
silently becomes per-replica. A silent no-op is the worst failure a distribution
library can have, so each module that overrides a hook calls `require_hook` when
it is imported, and fails loudly on a Keras that does not have it.
"""

import inspect
from typing import Optional

import keras

# The Keras releases these overrides were written for and tested with (the pin in
# pyproject.toml).
SUPPORTED_KERAS = ">=3.15,<3.16"


class KerasHookError(ImportError):
    """The installed Keras lacks a private method that expframe overrides."""


def require_hook(owner: type, name: str, user: str, consequence: str,
                 called_by: Optional[str] = None, set_by: Optional[str] = None) -> None:
    """Raises KerasHookError unless `owner` has the hook `name`, and uses it.

    Args:
      owner: the Keras class whose private method is overridden (or attribute read).
      name: the private method or attribute, e.g. "_moments".
      user: the expframe component that relies on it (for the message).
      consequence: what would go silently wrong without it (for the message).
      called_by: a method of `owner` whose code must refer to the method `name` (a
        hook that still exists but is no longer called is as silent as a missing one).
      set_by: for an instance attribute: the method of `owner` that must set it.
    """
    where = f"{owner.__module__}.{owner.__qualname__}"
    problem = None
    if set_by is None and not callable(getattr(owner, name, None)):
        problem = f"{where} has no method {name}"
    for method_name in (m for m in (called_by, set_by) if m):
        # The function itself, under decorators that wrap it (Keras filters tracebacks).
        method = getattr(owner, method_name, None)
        code = getattr(inspect.unwrap(method) if callable(method) else method, "__code__", None)
        if problem is None and (code is None or name not in code.co_names):
            verb = "calls" if method_name == called_by else "sets"
            problem = f"{where}.{method_name} no longer {verb} {name}"
    if problem:
        raise KerasHookError(
            f"{user} overrides a private Keras hook, but {problem} in Keras {keras.__version__}; "
            f"without it {consequence}. expframe supports Keras {SUPPORTED_KERAS}: "
            f"pip install 'keras{SUPPORTED_KERAS}'.")
