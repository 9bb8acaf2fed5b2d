"""What a study sweeps: read from a study file and the command line, expanded into runs.

A study file is gin, so it reads like the experiments it varies. `include` lines name
the base experiment, plain bindings fix values for every run, and a binding under
one of two reserved scopes is swept over the list it is given:

    include 'experiments/quickstart.gin'
    Trainer.log_every_steps = 25                      # every run
    zip/Trainer.global_batch_size = [64, 128, 256]    # these move together:
    zip/keras.optimizers.Adam.learning_rate = [1e-3, 2e-3, 4e-3]
    sweep/run_experiment.seed = [0, 1]                # grid: every combination

`sweep/` bindings form the grid; `zip/` bindings move together, one value of each
per run (more groups: `zip_lr/`, `zip_size/`, ...). A real gin scope follows the
reserved one: `sweep/generator/Adam.learning_rate = [...]`. On the command line,
`--sweep='B=[...]'` adds a grid binding and the `--zip='B=[...]'` flags form one zip
group; either replaces the study file's sweep of the same binding(s).

Parsing needs no TensorFlow; `validate` (which checks every binding with
`expframe.config.parse`) does.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tokenize
from typing import Sequence

from gin import config_parser

from expframe import gin_paths
from expframe.errors import ConfigError
from expframe.sweep import naming

GRID = "sweep"
_ZIP = re.compile(r"^zip(_\w+)?$")


class _Reference:
    """`@name` or `@name()` as parsed, written back the same way."""

    def __init__(self, name: str, evaluate: bool):
        self.name, self.evaluate = name, evaluate

    def __repr__(self) -> str:
        return f"@{self.name}{'()' if self.evaluate else ''}"


class _Macro:
    """`%NAME` as parsed, written back the same way."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"


class _Delegate(config_parser.ParserDelegate):
    def configurable_reference(self, scoped_configurable_name, evaluate):
        return _Reference(scoped_configurable_name, evaluate)

    def macro(self, macro_name):
        return _Macro(macro_name)


def to_gin(value) -> str:
    """Gin text of a parsed value: Python literals, lists, tuples, dicts, references."""
    return repr(value)  # containers repr their items; references and macros repr as gin.


@dataclasses.dataclass(frozen=True)
class Axis:
    """One dimension of a study: one binding over its values (grid), or several
    bindings moving together (zip).

    Attributes:
      bindings: the swept bindings as typed, e.g. `Trainer.global_batch_size`.
      values: one tuple per point along the axis: the gin text of each binding's value.
      origin: where it was given, for errors (`file.gin:12`, `--sweep`, `--zip`).
    """

    bindings: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]
    origin: str


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a study: its name (its directory under the study root) and values."""

    index: int
    name: str
    values: tuple[tuple[str, str], ...]  # (binding, gin text) in the study's order

    @property
    def gin_params(self) -> list[str]:
        return [f"{binding} = {text}" for binding, text in self.values]


@dataclasses.dataclass
class Study:
    """A base experiment (gin files and bindings) and the axes swept over it.

    Attributes:
      name: the study's name (its file's base name); the default root is runs/<name>.
      gin_files: base gin files, in order (the study file's includes, then --gin_file).
      gin_params: fixed bindings for every run (the study file's, then --gin_param).
      axes: the swept dimensions; the runs are their product.
    """

    name: str
    gin_files: list[str]
    gin_params: list[str]
    axes: list[Axis]

    @property
    def bindings(self) -> list[str]:
        return [b for axis in self.axes for b in axis.bindings]

    def keys(self) -> dict[str, str]:
        """Swept binding -> its short name in run names and tables."""
        return naming.short_keys(self.bindings)

    def runs(self) -> list[Run]:
        """Every run: the product of the axes, the last axis varying fastest."""
        keys = self.keys()
        names = {b: naming.value_names([point[j] for point in axis.values])
                 for axis in self.axes for j, b in enumerate(axis.bindings)}
        runs = []
        for index, points in enumerate(itertools.product(*(axis.values for axis in self.axes))):
            values = tuple((b, text) for axis, point in zip(self.axes, points, strict=True)
                           for b, text in zip(axis.bindings, point, strict=True))
            name = naming.run_name({b: names[b][text] for b, text in values}, keys)
            runs.append(Run(index, name, values))
        return runs


# -- parsing ------------------------------------------------------------------------------

def _statements(text: str, where: str, filename: str | None = None):
    """Gin statements of `text`; a syntax error is a ConfigError naming `where`."""
    try:
        source = open(filename, encoding="utf-8") if filename else text  # pylint: disable=consider-using-with
        try:
            return list(config_parser.ConfigParser(source, _Delegate()))
        finally:
            if filename:
                source.close()
    except SyntaxError as e:
        line = f":{e.lineno}" if filename and e.lineno else ""
        raise ConfigError(f"{where}{line}: {e.msg}; write gin, e.g. `Trainer.train_steps = [100, 200]`.") from None
    except tokenize.TokenError as e:  # an unclosed bracket or string
        line = f":{e.args[1][0]}" if filename else ""
        raise ConfigError(f"{where}{line}: {e.args[0]}; close every bracket and string.") from None


def _key(scope: str, selector: str, arg_name: str) -> str:
    return f"{scope + '/' if scope else ''}{selector}{'.' + arg_name if arg_name else ''}"


def _values(binding: str, value, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{where}: {binding} = {to_gin(value)} is not a list of values to sweep; "
                          f"write e.g. {binding} = [{to_gin(value)}, ...].")
    return tuple(to_gin(v) for v in value)


def _check_distinct(axis: Axis) -> Axis:
    repeated = sorted({p for p in axis.values if axis.values.count(p) > 1})
    if repeated:
        shown = ", ".join(f"{b} = {t}" for b, t in zip(axis.bindings, repeated[0], strict=True))
        raise ConfigError(f"{axis.origin}: {shown} comes twice; each run must differ "
                          "(sweep run_experiment.seed for repeats).")
    return axis


def _zip_axis(members: list[tuple[str, tuple[str, ...]]], origin: str) -> Axis:
    lengths = {b: len(v) for b, v in members}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{b} has {n}" for b, n in lengths.items())
        raise ConfigError(f"{origin}: zipped bindings move together and need as many values each ({listed}).")
    bindings = tuple(b for b, _ in members)
    return _check_distinct(Axis(bindings, tuple(zip(*(v for _, v in members), strict=True)), origin))


def _find_include(path: str, study_file: str) -> str:
    """An include's path as main.py can open it: as given if it exists from here, else
    as a gin file's include is found (expframe/gin_paths.py: next to the study file or
    in a directory above it, the gin search path, the shipped experiments)."""
    if os.path.isabs(path) or os.path.isfile(path):
        return path
    for candidate in gin_paths.candidates(path, including=os.path.abspath(study_file)):
        if os.path.isfile(candidate):
            relative = os.path.relpath(candidate)
            return candidate if relative.startswith("..") else relative
    return path  # config.parse reports the missing file.


def read_study_file(path: str) -> tuple[list[str], list[str], list[Axis]]:
    """Reads a study file: (includes, fixed bindings, axes in the file's order).

    Raises:
      ConfigError: a missing file, a syntax error, an import, an include after a
        binding, a swept value that is not a list, zipped lists of unequal length.
    """
    path = gin_paths.resolve(path, what=f"--study={path}")  # a path, or a shipped study by name
    includes, params, axes, groups = [], [], [], {}
    for statement in _statements("", path, filename=path):
        where = f"{path}:{statement.location.line_num}"
        if isinstance(statement, config_parser.IncludeStatement):
            if params or axes or groups:
                raise ConfigError(f"{where}: include '{statement.filename}' after a binding; put includes first.")
            includes.append(_find_include(statement.filename, path))
        elif isinstance(statement, config_parser.ImportStatement):
            raise ConfigError(f"{where}: imports are not read in a study file; put them in a gin file it includes.")
        elif isinstance(statement, config_parser.BindingStatement):
            directive, _, scope = statement.scope.partition("/")
            if directive != GRID and not _ZIP.match(directive):
                params.append(f"{_key(statement.scope, statement.selector, statement.arg_name)} = "
                              f"{to_gin(statement.value)}")
                continue
            binding = _key(scope, statement.selector, statement.arg_name)
            values = _values(binding, statement.value, where)
            if directive == GRID:
                axes.append(_check_distinct(Axis((binding,), tuple((v,) for v in values), where)))
            else:
                if directive not in groups:
                    groups[directive] = []
                    axes.append(directive)  # placeholder: the group's place in the file
                groups[directive].append((binding, values, where))
    out = []
    for axis in axes:
        if isinstance(axis, str):
            members = groups[axis]
            axis = _zip_axis([(b, v) for b, v, _ in members], f"{members[0][2]} ({axis}/)")
        out.append(axis)
    return includes, params, out


def parse_sweep(text: str, flag: str) -> tuple[str, tuple[str, ...]]:
    """`--sweep='Trainer.global_batch_size=[64, 128]'` -> (binding, value texts)."""
    where = f"--{flag}={text!r}"
    statements = _statements(text, where)
    if len(statements) != 1 or not isinstance(statements[0], config_parser.BindingStatement):
        raise ConfigError(f"{where}: expected one binding and its values, e.g. "
                          f"--{flag}='Trainer.global_batch_size=[64, 128]'.")
    s = statements[0]
    binding = _key(s.scope, s.selector, s.arg_name)
    return binding, _values(binding, s.value, where)


def _bound_keys(gin_params: Sequence[str]) -> dict[str, str]:
    """binding -> the --gin_param (or study line) that binds it."""
    keys = {}
    for param in gin_params:
        try:
            statements = list(config_parser.ConfigParser(param, _Delegate()))
        except SyntaxError:
            continue  # config.parse reports it, naming the binding.
        for s in statements:
            if isinstance(s, config_parser.BindingStatement):
                keys[_key(s.scope, s.selector, s.arg_name)] = param
    return keys


def build_study(study_file: str | None = None, gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
                sweeps: Sequence[str] = (), zips: Sequence[str] = (), name: str | None = None) -> Study:
    """The study from a study file (optional) and command-line flags.

    Args:
      study_file: a study file (see the module docstring), or None.
      gin_files: more base gin files (after the study file's includes).
      gin_params: more fixed bindings (after the study file's).
      sweeps: `--sweep` texts, one grid axis each.
      zips: `--zip` texts, together one zip axis.
      name: the study's name; default: the study file's base name, else the first
        gin file's base name + `_study`.

    Raises:
      ConfigError: anything wrong with the study's structure, in one line naming the
        binding (bindings themselves are checked by `validate`).
    """
    files, params, axes = read_study_file(study_file) if study_file else ([], [], [])
    files, params = files + list(gin_files), params + list(gin_params)
    cli = [_check_distinct(Axis((b,), tuple((v,) for v in values), f"--sweep={text!r}"))
           for text in sweeps for b, values in [parse_sweep(text, "sweep")]]
    if zips:
        cli.append(_zip_axis([parse_sweep(text, "zip") for text in zips], "--zip"))
    from_file = list(axes)
    for new in cli:  # a command-line sweep replaces the study file's sweep of the same bindings
        hit = [i for i, axis in enumerate(axes)
               if any(axis is a for a in from_file) and set(axis.bindings) & set(new.bindings)]
        for i in hit:
            if not set(axes[i].bindings) <= set(new.bindings):
                raise ConfigError(f"{new.origin}: {axes[i].origin} zips {', '.join(axes[i].bindings)} "
                                  f"together; give all of them with --zip, or none.")
        if hit:
            axes[hit[0]] = new
            axes = [a for i, a in enumerate(axes) if i not in hit[1:]]
        else:
            axes.append(new)
    if not files:
        raise ConfigError("no base experiment: give --gin_file=experiments/<name>.gin, or a --study file "
                          "that includes one.")
    if not axes:
        raise ConfigError("nothing to sweep: give --sweep='Trainer.global_batch_size=[64, 128]' (or --zip), "
                          "or a --study file with sweep/ or zip/ bindings.")
    seen = {}
    for axis in axes:
        for b in axis.bindings:
            if b in seen:
                raise ConfigError(f"{axis.origin}: {b} is swept twice (also at {seen[b]}); sweep it once.")
            seen[b] = axis.origin
    fixed = _bound_keys(params)
    for b in seen:
        if b in fixed:
            raise ConfigError(f"{fixed[b]!r} binds {b}, which the study sweeps ({seen[b]}); drop one of them.")
    if name is None:
        base = study_file or files[0]
        name = os.path.splitext(os.path.basename(base))[0] + ("" if study_file else "_study")
    return Study(name, files, params, axes)


# -- validation (imports TensorFlow through expframe.config) --------------------------------

def validate(study: Study) -> dict[str, str]:
    """Parses the base, every swept value and every run with `expframe.config.parse`.

    Returns:
      run name -> what its gin files and bindings parse to (`gin.config_str()`:
      includes expanded, later bindings win), the text main.py writes to
      parsed_config.gin; a run counts as finished only under the same text.

    Raises:
      ConfigError: one line naming the study file line or flag, the binding and
        gin's complaint, before anything runs or is written.
    """
    import gin  # pylint: disable=import-outside-toplevel

    from expframe import config  # pylint: disable=import-outside-toplevel
    try:
        try:
            config.parse(study.gin_files, study.gin_params)
        except ConfigError as e:
            raise ConfigError(f"base of study '{study.name}': {e}") from None
        for axis in study.axes:
            for point in axis.values:
                for binding, text in zip(axis.bindings, point, strict=True):
                    try:
                        config.parse(study.gin_files, study.gin_params + [f"{binding} = {text}"])
                    except ConfigError as e:
                        raise ConfigError(f"{axis.origin}: swept {binding} = {text}: {e}") from None
        texts = {}
        for run in study.runs():
            try:
                config.parse(study.gin_files, study.gin_params + run.gin_params)
            except ConfigError as e:
                raise ConfigError(f"run {run.name}: {e}") from None
            texts[run.name] = gin.config_str()
        return texts
    finally:
        gin.clear_config()
