"""The configuration's errors as gin raises them, each turned into one line that names
the file and line (or the binding) and what to do.

Two moments: while gin files and bindings are parsed (`explain`: a syntax error, an
unknown configurable or parameter, a module that cannot be imported) and while the
configurables are called (`config_error_from`: a missing binding, a value of the
wrong type or range). Gin keeps no record of where a value was bound, so the parse
records it (`record_binding`, from `expframe.config.parse`), and `located` puts the
file and line (or the --gin_param) before an error that names a bound binding
(`Trainer.train_steps=1000.0 must be ...`), whichever component raised it.

This module imports no expframe component, so any of them may use it (`bindings_to`
names what to change in an error); the registry that imports every component is
`expframe.config`.
"""

import difflib
import inspect
import os
import re
import tokenize
from typing import Dict, Iterable, List, Optional, Tuple

import gin

from expframe import gin_paths
from expframe.errors import ConfigError

# A gin `import` line (`import my_module`, `from pkg import module`).
IMPORT_STATEMENT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+)?import\s+([\w.]+)")
_LOCATION = re.compile(r'In file "([^"]+)", line (\d+)\n\s*(.*)')
_UNKNOWN = re.compile(r"No configurable matching (?:reference )?'@?([^'(]+)(?:\(\))?'")
_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")
# An error that starts with a binding and its value: `[scope/]Configurable.parameter=...`.
_NAMES_BINDING = re.compile(r"^(?:([\w./]+)/)?([\w.]+)\.(\w+) ?=")
# (scope, configurable's short name, parameter) -> where its last binding was parsed.
_BOUND_AT: Dict[Tuple[str, str, str], str] = {}
# How close a registered name must be to be offered as the one meant (difflib's ratio:
# 'Trainr' is 0.92 to 'Trainer'; 'WaveTask' is 0.62 to 'waves', another thing entirely).
CLOSE = 0.8


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`; did you mean 'X'?` for a candidate really close to `name`, else ''."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=CLOSE)
    return f"; did you mean '{close[0]}'?" if close else ""


def configurable_names() -> set:
    """Every registered configurable, by its full and its short name."""
    names = set()
    for selector, _ in gin.config._REGISTRY.items():  # pylint: disable=protected-access
        names.add(selector)
        names.add(selector.rsplit(".", 1)[-1])
    return names


def defining_modules(name: str, folders: Iterable[str]) -> List[str]:
    """The Python modules (`wave_task` for wave_task.py) directly in `folders` that define a
    class or function `name` at top level: the `import` a gin file that names it needs."""
    pattern = re.compile(rf"^(?:class|def)\s+{re.escape(name)}\b", re.MULTILINE)
    found = []
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        try:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))[:500]
        except OSError:
            continue
        for file in files:
            try:
                with open(os.path.join(folder, file), encoding="utf-8", errors="replace") as f:
                    text = f.read(1_000_000)
            except OSError:
                continue
            if pattern.search(text) and file[:-3] not in found:
                found.append(file[:-3])
    return found


def unknown_configurable(name: str, where: str, gin_file: Optional[str], prog: str = "python main.py") -> str:
    """The line for a configurable gin does not know: a typo of a registered name (when one
    is really close), else a module nobody imported (named when a .py file beside the gin
    file, on the gin search path or in the working directory defines it)."""
    short = name.rsplit(".", 1)[-1]
    close = suggest(name, configurable_names())
    if close:
        return f"{where}: unknown configurable '{name}'{close} (see `{prog} --list_configurables`)."
    folders = ([os.path.dirname(gin_file)] if gin_file else []) + gin_paths.search_path() + [os.getcwd()]
    modules = defining_modules(short, folders)
    module = modules[0] if modules else "<the module that defines it>"
    target = (f"to {gin_file}" if gin_file else f"as --gin_param='import {module}'")
    found = f" ({module}.py defines {short})" if modules else ""
    return (f"{where}: configurable '{name}' is not registered: add `import {module}` {target}{found}, "
            f"or see `{prog} --list_configurables` for the registered ones.")


def explain(error: Exception, where: str, error_file: Optional[str] = None) -> str:
    """Turns gin's multi-line parse error into one line naming the file and line, with a fix.

    Args:
      error: what gin raised while parsing.
      where: the flag it came from (`--gin_file=...`, `--gin_param=...`).
      error_file: the innermost gin file being read when it was raised, if any.
    """
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    location = _LOCATION.search(text)
    if isinstance(error, SyntaxError) and not isinstance(error, ConfigError):
        line = f"`{error.text.strip()}`" if error.text and error.text.strip() else ""
        place = f"{error.filename or error_file or where}:{error.lineno}" if error.lineno else where
        return f"{place}: gin syntax error: {error.msg.rstrip('.')}{' in ' + line if line else ''}."
    if isinstance(error, tokenize.TokenError):
        line = error.args[1][0] if len(error.args) > 1 else None
        place = f"{error_file}:{line}" if error_file and line else (error_file or where)
        return f"{place}: gin syntax error: {error.args[0]}; close every bracket and string."
    if location:
        where = f"{location.group(1)}:{location.group(2)}"
    if isinstance(error, ModuleNotFoundError) and not isinstance(error, ConfigError):
        statement = IMPORT_STATEMENT.match(location.group(3)) if location else None
        module = (statement.group(2) if statement and not statement.group(1) else
                  statement.group(1) if statement else getattr(error, "name", None) or "?")
        original = error  # gin re-raises a proxy without `name`; the original is its context
        while original is not None and getattr(original, "name", None) is None:
            original = original.__context__
        missing = getattr(original, "name", None) or module
        return gin_paths.missing_module_error(module, missing,
                                              location.group(1) if location else None,
                                              int(location.group(2)) if location else None)
    if isinstance(error, ConfigError):
        return first
    unknown = _UNKNOWN.search(text)
    if unknown:
        gin_file = location.group(1) if location else error_file
        return unknown_configurable(unknown.group(1), where, gin_file)
    param = _PARAMETER.search(text)
    if param:
        configurable, parameter = param.groups()
        params = []
        try:
            selector = gin.config._REGISTRY.get_match(configurable)  # pylint: disable=protected-access
            params = list(inspect.signature(selector.wrapped).parameters)
        except Exception:  # noqa: BLE001  (no suggestion then)
            pass
        return f"{where}: '{configurable}' has no parameter '{parameter}'{suggest(parameter, params)}"
    return f"{where}: {first}"


_INNERMOST = re.compile(r"In call to configurable '([^']+)'")
_MISSING = re.compile(r"Required bindings for `?([\w.]+)`? not provided in config: \[(.*?)\]")
_UNSUPPLIED = re.compile(r"No values supplied by Gin or caller for arguments: \[(.*?)\]")
# Configurables whose own body is the run: an error annotated only with these came
# from the run itself (a bug or a failure), not from a bound value.
_RUN_CONFIGURABLES = ("run_experiment",)


def _names(listed: str) -> List[str]:
    return [name.strip().strip("'\"") for name in listed.split(",") if name.strip()]


def _bindings_of(configurable: str) -> str:
    """`name=value, ...` of what the config binds on `configurable` (any scope)."""
    bound = []
    for (_, selector), params in gin.config._CONFIG.items():  # pylint: disable=protected-access
        if selector == configurable or selector.endswith("." + configurable):
            bound += [f"{name}={value!r}" for name, value in params.items()]
    text = ", ".join(bound)
    return text if len(text) <= 300 else text[:297] + "..."


def config_error_from(error: Exception) -> Optional[ConfigError]:
    """The one-line ConfigError for an error gin raised while calling configurables.

    Gin raises a RuntimeError for a missing required binding, and re-raises what a
    configurable raised, appending "In call to configurable 'X'" for each enclosing
    configurable. This maps: a missing required binding (or an argument nobody
    supplied) to "missing binding(s) X.p", and a TypeError or ValueError raised in
    configurable X (a value of the wrong type or range) to a line naming X and the
    values bound on it.

    Returns:
      The ConfigError, or None when `error` is not the configuration's fault (it
      came from the run itself; re-raise it).
    """
    if isinstance(error, ConfigError):
        return ConfigError(str(error).strip().splitlines()[0])
    text = str(error)
    missing = _MISSING.search(text)
    unsupplied = _UNSUPPLIED.search(text)
    calls = _INNERMOST.findall(text)
    if missing or (unsupplied and calls):
        owner, params = (missing.group(1), missing.group(2)) if missing else (calls[0], unsupplied.group(1))
        names = ", ".join(f"{owner}.{p}" for p in _names(params))
        return ConfigError(f"missing binding(s) {names}; set them in the gin file or with --gin_param.")
    if not isinstance(error, (TypeError, ValueError)) or not calls or calls[0] in _RUN_CONFIGURABLES:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    bound = _bindings_of(calls[0])
    return ConfigError(f"{calls[0]}: {first} ({'bound: ' + bound if bound else 'nothing bound'}); "
                       f"check the type and value of its bindings.")


def bindings_to(name: str) -> List[str]:
    """The gin bindings (e.g. `resnet.norm`) whose value refers to the configurable
    `name` (`@name`, `@module.name` or `@name()`): for errors that say what to change."""
    pattern = re.compile(rf"^(\S+) = @(?:[\w.]+\.)?{re.escape(name)}(?:\(\))?$")
    return [m.group(1) for m in map(pattern.match, gin.config_str().splitlines()) if m]


def forget_bindings() -> None:
    """Starts a new record of where bindings are (a new parse)."""
    _BOUND_AT.clear()


def record_binding(scope: str, selector: str, parameter: str, where: str) -> None:
    """Notes that `scope/selector.parameter` was bound at `where` (`path:line`, or
    `--gin_param='...'`); a later binding of the same parameter replaces it, as in gin."""
    _BOUND_AT[(scope or "", selector.rsplit(".", 1)[-1], parameter)] = where


def located(message: str) -> str:
    """`message`, with the file and line (or --gin_param) of the binding it starts with
    put before it: `experiments/x.gin:12: Trainer.train_steps=1000.0 must be a positive
    integer.` Unchanged when it names no recorded binding (or already starts with one)."""
    named = _NAMES_BINDING.match(message)
    if not named:
        return message
    where = _BOUND_AT.get((named.group(1) or "", named.group(2).rsplit(".", 1)[-1], named.group(3)))
    return f"{where}: {message}" if where else message

