"""Where gin files, their includes and the Python modules they import are found.

The same rules hold for `main.py`, the `expframe` command, `python -m expframe.sweep`
and `python -m expframe.launch` (whose workers parse the same arguments in the same
working directory), from any working directory:

- `--gin_file=F`: F as given (absolute, or relative to the working directory), then
  in each folder of the gin search path, then in the shipped `experiments/` folder.
  A name works too: `--gin_file=quickstart` is the shipped
  `experiments/quickstart.gin` (`.gin` may be left out; a leading `experiments/`
  names the shipped folder, so `experiments/quickstart.gin` works from anywhere).
- `include 'F'` inside a gin file: relative to the including file's folder, then to
  each folder above it (nearest first, so `include 'experiments/targets/cpu.gin'`
  from a file in `experiments/` finds the sibling folder), then the gin search path,
  then the shipped `experiments/` folder, then the working directory. An include
  in a `--gin_param` starts at the working directory, as `--gin_file` does.
- `import my_module` inside a gin file: Python's import, with the folder of every
  gin file that has an import statement put first on `sys.path` (so `my_module.py`
  beside the gin file is found), then the gin search path, then `PYTHONPATH` and the
  rest of `sys.path`. These folders are also put on `PYTHONPATH` for the processes
  the run starts (D4PG's actor processes parse the same config).

The gin search path is `--gin_search_path=DIR` (repeatable), then the folders of
`$EXPFRAME_GIN_PATH` (separated by `os.pathsep`, `:` on Linux).

The shipped `experiments/` folder is the clone's `experiments/` (a source checkout
or an editable install), else the copy inside the installed package
(`expframe/experiments/`, package data of a `pip install .`).
"""

import os
import sys
from typing import List, Optional, Sequence

from expframe.errors import ConfigError

SEARCH_PATH_ENV = "EXPFRAME_GIN_PATH"
SHIPPED = "experiments"


def shipped_dir() -> Optional[str]:
    """The shipped experiments folder: the clone's, else the installed package's."""
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    clone = os.path.join(root, SHIPPED)
    if os.path.isdir(clone) and os.path.isfile(os.path.join(root, "pyproject.toml")):
        return clone
    installed = os.path.join(package, SHIPPED)
    return installed if os.path.isdir(installed) else None


def search_path() -> List[str]:
    """The gin search path: `$EXPFRAME_GIN_PATH`'s folders (`--gin_search_path` adds to it)."""
    return [os.path.abspath(d) for d in os.environ.get(SEARCH_PATH_ENV, "").split(os.pathsep) if d]


def add_search_path(folders: Sequence[str]) -> None:
    """Puts `folders` first on the gin search path, for this process and the processes
    it starts (they inherit `$EXPFRAME_GIN_PATH`)."""
    missing = [d for d in folders if not os.path.isdir(d)]
    if missing:
        raise ConfigError(f"--gin_search_path={missing[0]}: no such folder.")
    merged = [os.path.abspath(d) for d in folders] + [d for d in search_path() if d not in folders]
    os.environ[SEARCH_PATH_ENV] = os.pathsep.join(dict.fromkeys(merged))


def _variants(path: str) -> List[str]:
    return [path] if path.endswith(".gin") else [path, path + ".gin"]


def _shipped_candidates(path: str) -> List[str]:
    shipped = shipped_dir()
    if shipped is None:
        return []
    relative = path[len(SHIPPED) + 1:] if path.startswith(SHIPPED + "/") else path
    return [os.path.join(shipped, v) for v in _variants(relative)]


def _above(folder: str) -> List[str]:
    """`folder` and every folder above it, nearest first."""
    out = [folder]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def candidates(path: str, including: Optional[str] = None) -> List[str]:
    """Where `path` is looked for, in order (see the module docstring).

    Args:
      path: a `--gin_file` value or an include's path.
      including: the absolute path of the gin file whose `include` names `path`, or
        None for a path from the command line.
    """
    if os.path.isabs(path):
        return _variants(path)
    if including is None:
        first = [os.getcwd()]
        last = []
    else:
        first = _above(os.path.dirname(including))
        last = [os.getcwd()]
    out = [os.path.join(d, v) for d in first + search_path() for v in _variants(path)]
    out += _shipped_candidates(path)
    out += [os.path.join(d, v) for d in last for v in _variants(path)]
    return list(dict.fromkeys(os.path.normpath(p) for p in out))


def resolve(path: str, including: Optional[str] = None, what: Optional[str] = None) -> str:
    """The absolute path of the first candidate that is a file.

    Raises:
      ConfigError: none is; the line names `what` (default: the path), the places
        looked in, and the shipped experiments.
    """
    for candidate in candidates(path, including):
        if os.path.isfile(candidate):
            return candidate
    what = what or (f"include '{path}' in {including}" if including else f"--gin_file={path}")
    where = [f"the working directory {os.getcwd()}" if including is None
             else f"{os.path.dirname(including)} and the folders above it"]
    if search_path():
        where.append(f"${SEARCH_PATH_ENV}/--gin_search_path ({os.pathsep.join(search_path())})")
    shipped = shipped_dir()
    where.append(f"the shipped experiments ({shipped})" if shipped else "no shipped experiments (not found)")
    names = ", ".join(n for n in shipped_names() if "/" not in n)
    raise ConfigError(f"{what}: no such file (looked in {'; '.join(where)}). Shipped experiments, by name: "
                      f"{names or 'none'}.")


def shipped_names() -> List[str]:
    """Names of the shipped experiments (`quickstart`, `targets/cpu`, ...), sorted."""
    shipped = shipped_dir()
    names = []
    for folder, _, files in os.walk(shipped or ""):
        for name in files:
            if name.endswith(".gin"):
                names.append(os.path.relpath(os.path.join(folder, name), shipped)[:-len(".gin")])
    return sorted(names, key=lambda n: ("/" in n, n))


# -- Python modules that gin files import ------------------------------------------------

_module_dirs: List[str] = []


def add_module_dir(folder: str) -> None:
    """Puts `folder` first on `sys.path` and on `PYTHONPATH` for child processes (once)."""
    folder = os.path.abspath(folder)
    if folder in _module_dirs:
        return
    _module_dirs.append(folder)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != folder]
    os.environ["PYTHONPATH"] = os.pathsep.join([folder] + current)


def module_dirs() -> List[str]:
    """The folders added for gin imports so far (gin files' folders, the search path)."""
    return list(_module_dirs)


def missing_module_error(module: str, missing: str, gin_file: Optional[str], line: Optional[int]) -> str:
    """The one line for `import module` in a gin file that Python cannot import."""
    where = f"{gin_file}:{line}" if gin_file and line else (gin_file or "--gin_param")
    if missing != module and not module.startswith(missing + "."):
        return (f"{where}: import {module} failed: No module named '{missing}' (imported by {module}); "
                f"install it, or fix the import in {module}.")
    places = ([f"beside the gin file ({os.path.dirname(gin_file)})"] if gin_file else [])
    places.append(f"the gin search path ({os.pathsep.join(search_path())})" if search_path()
                  else "the gin search path (empty)")
    places.append("PYTHONPATH and sys.path")
    return (f"{where}: import {module}: no module named '{missing}'; looked {', '.join(places)}. Put "
            f"{missing.split('.')[0]}.py beside the gin file, or add its folder with --gin_search_path=DIR "
            f"(or ${SEARCH_PATH_ENV}=DIR, or PYTHONPATH=DIR).")
