"""Gin: the one registry. Registers the Keras symbols expframe's gin files use and
parses gin files and bindings into clear, one-line configuration errors.

`gin.tf` does not import with TF 2.21 (it needs the removed `tf.estimator`), so
the TF/Keras symbols are registered here under the module names users type
(`@keras.optimizers.SGD`, `@SGD` for short).
"""

import contextlib
import difflib
import os
import re
import tokenize
from typing import List, Optional, Sequence

import gin
import keras

from expframe import gin_paths
from expframe.errors import ConfigError

_KERAS_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Lion")
_KERAS_SCHEDULES = ("PiecewiseConstantDecay", "CosineDecay", "ExponentialDecay", "PolynomialDecay")
_registered = False


def register_symbols() -> None:
    """Registers Keras optimizers, schedules and layers with gin (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name in _KERAS_OPTIMIZERS:
        gin.external_configurable(getattr(keras.optimizers, name), name=name, module="keras.optimizers")
    for name in _KERAS_SCHEDULES:
        gin.external_configurable(getattr(keras.optimizers.schedules, name), name=name,
                                  module="keras.optimizers.schedules")
    gin.external_configurable(keras.layers.BatchNormalization, name="BatchNormalization", module="keras.layers")
    # A Keras layer class cannot be decorated in place (Keras reads __init__'s
    # argument names, which gin's wrapper hides): register it from outside.
    from expframe.layers import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    gin.external_configurable(SyncBatchNorm, name="SyncBatchNorm", module="expframe.layers")
    # Import the modules whose configurables gin files may reference.
    # pylint: disable=import-outside-toplevel,unused-import
    import expframe.data.imagenet  # noqa: F401
    import expframe.data.inputs  # noqa: F401
    import expframe.experiment  # noqa: F401
    import expframe.metrics  # noqa: F401
    import expframe.models.d4pg  # noqa: F401
    import expframe.models.resnet  # noqa: F401
    import expframe.models.sngan  # noqa: F401
    import expframe.models.vit  # noqa: F401
    import expframe.replicator.mesh_optimizer  # noqa: F401
    import expframe.rl.environments  # noqa: F401
    import expframe.schedules  # noqa: F401
    import expframe.tasks  # noqa: F401
    import expframe.tasks.mesh_classification  # noqa: F401


def _suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _configurable_names():
    names = set()
    for selector, _ in gin.config._REGISTRY.items():  # pylint: disable=protected-access
        names.add(selector)
        names.add(selector.rsplit(".", 1)[-1])
    return names


_LOCATION = re.compile(r'In file "([^"]+)", line (\d+)\n\s*(.*)')
_IMPORT_STATEMENT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+)?import\s+([\w.]+)")


def _explain(error: Exception, where: str, error_file: Optional[str] = None) -> str:
    """Turns gin's multi-line error into one line naming the file and line, with a suggestion.

    Args:
      error: what gin raised.
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
        statement = _IMPORT_STATEMENT.match(location.group(3)) if location else None
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
    missing = re.search(r"No configurable matching '([^']+)'", text)
    if missing:
        return (f"{where}: unknown configurable '{missing.group(1)}'"
                f"{_suggest(missing.group(1), _configurable_names())} "
                "(see `python main.py --list_configurables`, and import the module that defines it).")
    param = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
    if param:
        configurable, parameter = param.groups()
        params = []
        try:
            selector = gin.config._REGISTRY.get_match(configurable)  # pylint: disable=protected-access
            import inspect  # pylint: disable=import-outside-toplevel
            params = list(inspect.signature(selector.wrapped).parameters)
        except Exception:  # pylint: disable=broad-except
            pass
        return (f"{where}: '{configurable}' has no parameter '{parameter}'"
                f"{_suggest(parameter, params)}")
    return f"{where}: {first}"


_INNERMOST = re.compile(r"In call to configurable '([^']+)'")
_MISSING = re.compile(r"Required bindings for `?([\w.]+)`? not provided in config: \[(.*?)\]")
_UNSUPPLIED = re.compile(r"No values supplied by Gin or caller for arguments: \[(.*?)\]")
# Configurables whose own body is the run: an error annotated only with these came
# from the run itself (a bug or a failure), not from a bound value.
_RUN_CONFIGURABLES = ("run_experiment",)


def _names(listed: str):
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


class _GinFiles:
    """Gin's file reader for expframe (registered first): finds each file and include as
    `expframe.gin_paths` says, and puts the folder of a gin file that imports Python
    modules on `sys.path`."""

    def __init__(self):
        self.stack: List[str] = []  # the files being read, innermost last
        self.error_file: Optional[str] = None

    def exists(self, path: str) -> bool:  # pylint: disable=unused-argument
        return True  # `open` resolves it, or raises a ConfigError naming where it looked

    @contextlib.contextmanager
    def open(self, path: str):
        if self.stack:
            resolved = gin_paths.resolve(path, self.stack[-1])
        else:  # an absolute --gin_file (parse resolved it), or an include in a --gin_param
            resolved = gin_paths.resolve(path, what=f"include '{path}' in --gin_param")
        with open(resolved, encoding="utf-8") as f:
            if any(_IMPORT_STATEMENT.match(line) for line in f):
                gin_paths.add_module_dir(os.path.dirname(resolved))
            f.seek(0)
            self.stack.append(resolved)
            try:
                yield f
            except BaseException:
                self.error_file = self.error_file or resolved
                raise
            finally:
                self.stack.pop()


_FILES = _GinFiles()


def _install_reader() -> None:
    """Puts `_FILES` first among gin's file readers (before `open`, and before gin's
    package-resource reader, which fails on a namespace package such as `experiments`)."""
    readers = gin.config._FILE_READERS  # pylint: disable=protected-access
    entry = (_FILES.open, _FILES.exists)
    if readers and readers[0] == entry:
        return
    if entry in readers:
        readers.remove(entry)
    readers.insert(0, entry)


def parse(gin_files: Sequence[str], gin_params: Sequence[str]) -> str:
    """Parses gin files then bindings; returns the config text 'as given'.

    Files, includes and imported modules are found as `expframe.gin_paths` says (any
    working directory; shipped experiments by name).

    Raises:
      ConfigError: a missing file, a syntax error, an unknown configurable or
        parameter, a module that cannot be imported, each in one line naming the
        file and line, or the binding.
    """
    register_symbols()
    _install_reader()
    gin.clear_config()
    for folder in reversed(gin_paths.search_path()):
        gin_paths.add_module_dir(folder)
    given = []
    for path in gin_files:
        resolved = gin_paths.resolve(path)
        _FILES.error_file = None
        try:
            gin.parse_config_file(resolved)
        except Exception as e:  # gin raises many types; all are the user's config.
            raise ConfigError(_explain(e, f"--gin_file={path}", _FILES.error_file)) from None
        with open(resolved, encoding="utf-8") as f:
            given.append(f"# --gin_file={path}\n{f.read().rstrip()}\n")
    for binding in gin_params:
        _FILES.error_file = None
        try:
            gin.parse_config(binding)
        except Exception as e:  # pylint: disable=broad-except
            raise ConfigError(_explain(e, f"--gin_param={binding!r}", _FILES.error_file)) from None
        given.append(f"# --gin_param\n{binding}\n")
    return "\n".join(given)


def bindings_to(name: str) -> list:
    """The gin bindings (e.g. `resnet.norm`) whose value refers to the configurable
    `name` (`@name`, `@module.name` or `@name()`): for errors that say what to change."""
    pattern = re.compile(rf"^(\S+) = @(?:[\w.]+\.)?{re.escape(name)}(?:\(\))?$")
    return [m.group(1) for m in map(pattern.match, gin.config_str().splitlines()) if m]
