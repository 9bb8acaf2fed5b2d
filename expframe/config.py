"""Gin: the one registry, on the top floor. Imports every component so that gin knows its
configurables, registers the Keras symbols expframe's gin files use, and parses gin
files and bindings (errors become one line: `expframe.gin_errors`).

Nothing below the command line imports this module: the helpers that components use
when they report a configuration error live in `expframe.gin_errors`.

`gin.tf` does not import with TF 2.21 (it needs the removed `tf.estimator`), so
the TF/Keras symbols are registered here under the module names users type
(`@keras.optimizers.SGD`, `@SGD` for short).
"""

import contextlib
import os
import re
from typing import List, Optional, Sequence

import gin
import keras
from gin import config_parser

from expframe import gin_errors, gin_paths
from expframe.errors import ConfigError
from expframe.gin_errors import IMPORT_STATEMENT, explain

_KERAS_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Lion")
_KERAS_SCHEDULES = ("PiecewiseConstantDecay", "CosineDecay", "ExponentialDecay", "PolynomialDecay")
# For compile() in gin (KerasModelTask): `@keras.losses.SparseCategoricalCrossentropy()`; a
# metric named like a loss is told apart by its module (`@keras.metrics.MeanSquaredError()`).
_KERAS_LOSSES = ("SparseCategoricalCrossentropy", "CategoricalCrossentropy", "BinaryCrossentropy",
                 "MeanSquaredError", "MeanAbsoluteError", "Huber")
_KERAS_METRICS = ("SparseCategoricalAccuracy", "CategoricalAccuracy", "BinaryAccuracy",
                  "SparseTopKCategoricalAccuracy", "TopKCategoricalAccuracy", "AUC", "Precision", "Recall",
                  "MeanSquaredError", "MeanAbsoluteError", "SparseCategoricalCrossentropy")
_registered = False


def register_symbols() -> None:
    """Registers Keras optimizers, schedules, losses, metrics and layers with gin (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name in _KERAS_OPTIMIZERS:
        gin.external_configurable(getattr(keras.optimizers, name), name=name, module="keras.optimizers")
    for name in _KERAS_SCHEDULES:
        gin.external_configurable(getattr(keras.optimizers.schedules, name), name=name,
                                  module="keras.optimizers.schedules")
    for module, names in (("losses", _KERAS_LOSSES), ("metrics", _KERAS_METRICS)):
        for name in names:
            gin.external_configurable(getattr(getattr(keras, module), name), name=name, module=f"keras.{module}")
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
    import expframe.models.pixel_encoder  # noqa: F401
    import expframe.models.resnet  # noqa: F401
    import expframe.models.sngan  # noqa: F401
    import expframe.models.vit  # noqa: F401
    import expframe.replicator.mesh_optimizer  # noqa: F401
    import expframe.rl.environments  # noqa: F401
    import expframe.schedules  # noqa: F401
    import expframe.tasks  # noqa: F401
    import expframe.tasks.mesh_classification  # noqa: F401


def _include_place(including: str, path: str) -> str:
    """`file:line` of the include statement of `path` in the gin file `including` (the
    first such line), or the file alone if it cannot be found."""
    statement = re.compile(r"^\s*include\s+(['\"])" + re.escape(path) + r"\1")
    try:
        with open(including, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if statement.match(line):
                    return f"{including}:{number}"
    except OSError:
        pass
    return including


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
            including = self.stack[-1]
            resolved = gin_paths.resolve(path, including,
                                         what=f"include '{path}' in {_include_place(including, path)}")
        else:  # an absolute --gin_file (parse resolved it), or an include in a --gin_param
            resolved = gin_paths.resolve(path, what=f"include '{path}' in --gin_param")
        with open(resolved, encoding="utf-8") as f:
            if any(IMPORT_STATEMENT.match(line) for line in f):
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


class _ValuesUnread(config_parser.ParserDelegate):
    """Parses references and macros to nothing: `_record_bindings` wants only where each
    binding is (gin itself has already parsed the values)."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return None

    def macro(self, macro_name):
        return None


def _record_bindings(text: str, where: str, path: Optional[str] = None, depth: int = 0) -> None:
    """Notes where each binding of `text` (a gin file at `path`, or a --gin_param) is, its
    includes' in their place, in the order gin applies them (`gin_errors.record_binding`).
    Gin has parsed the same text already; should this second reading fail, errors are
    only left without their location."""
    try:
        statements = list(config_parser.ConfigParser(text, _ValuesUnread()))
    except Exception:  # noqa: BLE001  (see the docstring)
        return
    for statement in statements:
        if isinstance(statement, config_parser.BindingStatement) and statement.arg_name:
            place = f"{path}:{statement.location.line_num}" if path else where
            gin_errors.record_binding(statement.scope, statement.selector, statement.arg_name, place)
        elif isinstance(statement, config_parser.IncludeStatement) and depth < 20:
            included = gin_paths.resolve(statement.filename, path, what=f"include '{statement.filename}' in {where}")
            with open(included, encoding="utf-8") as f:
                _record_bindings(f.read(), where, included, depth + 1)


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
    gin_errors.forget_bindings()
    for folder in reversed(gin_paths.search_path()):
        gin_paths.add_module_dir(folder)
    given = []
    for path in gin_files:
        resolved = gin_paths.resolve(path)
        _FILES.error_file = None
        try:
            gin.parse_config_file(resolved)
        except Exception as e:  # gin raises many types; all are the user's config.
            raise ConfigError(explain(e, f"--gin_file={path}", _FILES.error_file)) from None
        with open(resolved, encoding="utf-8") as f:
            text = f.read()
        _record_bindings(text, f"--gin_file={path}", resolved)
        given.append(f"# --gin_file={path}\n{text.rstrip()}\n")
    for binding in gin_params:
        _FILES.error_file = None
        try:
            gin.parse_config(binding)
        except Exception as e:  # pylint: disable=broad-except
            raise ConfigError(explain(e, f"--gin_param={binding!r}", _FILES.error_file)) from None
        _record_bindings(binding, f"--gin_param={binding!r}")
        given.append(f"# --gin_param\n{binding}\n")
    return "\n".join(given)

