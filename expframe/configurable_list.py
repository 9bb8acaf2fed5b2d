"""`--list_configurables`: every gin configurable, its parameters and their defaults."""

import inspect
from typing import List, NamedTuple, Optional

import gin

REQUIRED = "REQUIRED"
FROM_CALLER = "(passed by the caller)"
NO_DOCSTRING = "(no docstring)"


class Configurable(NamedTuple):
    """One configurable as a gin file names it."""

    name: str  # e.g. 'Trainer', 'keras.optimizers.Adam'
    selector: str  # the full name, e.g. 'expframe.trainer.Trainer'
    summary: str  # the first line of its own docstring, or NO_DOCSTRING
    parameters: List[tuple]  # (parameter, default as gin text, or REQUIRED / FROM_CALLER)


def _default(value) -> str:
    if value is gin.REQUIRED:
        return REQUIRED
    if value is inspect.Parameter.empty:
        return FROM_CALLER
    text = repr(value)
    if inspect.isclass(value) or inspect.isfunction(value):
        text = f"<{value.__module__}.{value.__qualname__}>"
    return text if len(text) <= 70 else text[:67] + "..."


def summary(wrapped) -> str:
    """The first line of the configurable's own docstring, or NO_DOCSTRING.

    Its own: `inspect.getdoc` would show a base class's docstring for a subclass
    without one (a user's Task would read as the Task it extends)."""
    own = wrapped.__dict__.get("__doc__") if inspect.isclass(wrapped) else getattr(wrapped, "__doc__", None)
    text = inspect.cleandoc(own) if isinstance(own, str) else ""
    return text.splitlines()[0] if text else NO_DOCSTRING


def configurables(match: Optional[str] = None) -> List[Configurable]:
    """The registered configurables (gin's own builtins left out), by name.

    Args:
      match: keep those whose name contains this text (case-insensitive).
    """
    out = []
    for selector, entry in gin.config._REGISTRY.items():  # pylint: disable=protected-access
        if entry.module.split(".")[0] == "gin":
            continue
        name = selector if entry.module.startswith("keras") else entry.name
        if match and match.lower() not in selector.lower():
            continue
        try:
            signature = inspect.signature(entry.wrapped)
        except (TypeError, ValueError):
            signature = None
        params = []
        for param in (signature.parameters.values() if signature else []):
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if entry.denylist and param.name in entry.denylist:
                continue
            if entry.allowlist and param.name not in entry.allowlist:
                continue
            params.append((param.name, _default(param.default)))
        out.append(Configurable(name, selector, summary(entry.wrapped), params))
    return sorted(out, key=lambda c: (c.name.startswith("keras"), c.name.lower()))


def format_list(items: List[Configurable]) -> str:
    """The text `--list_configurables` prints."""
    lines = [f"{len(items)} configurables (bind as `Name.parameter = value` in a gin file or with --gin_param; "
             f"{REQUIRED} must be bound; {FROM_CALLER}: the code that calls it supplies it):", ""]
    for item in items:
        lines.append(f"{item.name}  [{item.selector}]  {item.summary}")
        lines += [f"    {name} = {default}" for name, default in item.parameters]
        lines.append("")
    return "\n".join(lines)
