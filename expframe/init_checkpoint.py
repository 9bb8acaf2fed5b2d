"""Fine-tuning from another run: a restore at step 0, with a choice of what is taken.

    run_experiment.init_checkpoint = 'runs/quickstart'           # another run's model_dir
    run_experiment.init_include = ['model']                       # what is taken (default: every model)
    run_experiment.init_exclude = ['model/resnet/logits']         # left at its initial values

`init_checkpoint` is a model_dir (its newest checkpoint), its `best/` folder (the best
checkpoint, expframe/best_checkpoint.py) or a checkpoint prefix (`DIR/checkpoints/ckpt-N`).
Variables are named `<trackable>/<variable path>`: the task's `trackables()` key (`model`,
`optimizer`, `generator`, `policy`, ...) and the variable's Keras path
(`model/resnet/stem/conv/kernel`, `optimizer/sgd/...`). An entry of `init_include` or
`init_exclude` takes every variable whose name is it or starts with it and a `/`, so
`model` takes the whole model, `optimizer` its slots and iteration count, and
`model/resnet/logits` one layer. The default takes every trackable but the optimizers:
weights without slots.

It applies only when the run starts at step 0: a run that resumes continues from its own
checkpoint. The start prints what was restored and what was left at its initial value
and why (excluded, not selected, not in the checkpoint). An entry that matches no
variable the checkpoint and the task share, or a taken variable whose shape differs, is a
ConfigError (one line, exit 2) before anything is written. The step counter and the
data position are never taken: the run starts at step 0 of its own data.
"""

import collections
import contextlib
import os
from typing import Dict, List, Optional, Sequence

import keras
import tensorflow as tf

from expframe.best_checkpoint import FOLDER, INDEX, path_of
from expframe.checkpointer import checkpoints_in, node_paths
from expframe.errors import ConfigError

_BINDING = "run_experiment.init_checkpoint"


def source_path(source: str) -> str:
    """The checkpoint prefix that `init_checkpoint` names (see the module docstring)."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{_BINDING}={source!r} must be a path: another run's model_dir, its best/ folder or a "
                          "checkpoint prefix (DIR/checkpoints/ckpt-N).")
    if os.path.isfile(source + ".index"):
        return source
    if os.path.isfile(os.path.join(source, INDEX)):  # a best/ folder
        return path_of(os.path.dirname(os.path.normpath(source)))
    for folder in (os.path.join(source, "checkpoints"), source):
        found = checkpoints_in(folder) if os.path.isdir(folder) else []
        if found:
            return found[0][1]
    raise ConfigError(f"{_BINDING}={source!r}: no checkpoint there; give another run's model_dir, its {FOLDER}/ "
                      "folder or a checkpoint prefix (DIR/checkpoints/ckpt-N).")


def _is_variable(obj) -> bool:
    return isinstance(obj, (tf.Variable, keras.Variable))


def _name(top: str, variable) -> str:
    path = getattr(variable, "path", None) or variable.name.split(":")[0]
    return f"{top}/{path}"


def _is_optimizer(obj) -> bool:
    return isinstance(obj, keras.optimizers.Optimizer) or hasattr(obj, "apply_gradients") or (
        type(obj).__name__.endswith(("Optimizer", "Adam")))


def live_variables(trackables: Dict[str, object]) -> Dict[str, object]:
    """Every variable of the task's trackables, by name (`<trackable>/<variable path>`)."""
    out, seen = {}, set()
    for top, obj in trackables.items():
        if not isinstance(obj, tf.__internal__.tracking.Trackable):
            continue
        for child in tf.train.TrackableView(obj).descendants():
            # A variable reachable from two trackables (an optimizer tracks the model's
            # variables it updates) is named after the first, in trackables() order.
            if _is_variable(child) and id(child) not in seen:
                seen.add(id(child))
                out.setdefault(_name(top, child), child)
    return out


def _keys(trackables: Dict[str, object], path: str) -> Dict[int, str]:
    """id(variable) -> its key in the checkpoint at `path`, for the variables both hold."""
    view = tf.train.CheckpointView(path)
    paths = node_paths(view)
    matched = view.match(tf.train.Checkpoint(**trackables))
    return {id(obj): f"{paths[node]}/.ATTRIBUTES/VARIABLE_VALUE" for node, obj in matched.items()
            if _is_variable(obj) and node in paths}


def _selected(name: str, entries: Sequence[str]) -> Optional[str]:
    return next((e for e in entries if name == e or name.startswith(e.rstrip("/") + "/")), None)


def _check_entries(binding: str, entries: Sequence[str], names: List[str]) -> None:
    if isinstance(entries, str) or not all(isinstance(e, str) and e for e in entries):
        raise ConfigError(f"{binding}={entries!r} must be a list of names, e.g. ['model'] or ['model/resnet/logits'].")
    tops = sorted({n.split("/")[0] for n in names})
    for entry in entries:
        if not any(_selected(n, [entry]) for n in names):
            raise ConfigError(f"{binding} entry {entry!r} matches no variable that the checkpoint and this task "
                              f"share; names are <trackable>/<variable path> with trackables {tops}, e.g. "
                              f"{names[0]!r}.")


def restore(trackables: Dict[str, object], source: str, include: Optional[Sequence[str]] = None,
            exclude: Sequence[str] = (), replicator=None) -> Dict[str, object]:
    """Assigns the chosen variables of the checkpoint `source` names to the task's.

    Args:
      trackables: the task's `trackables()`.
      source: `run_experiment.init_checkpoint`.
      include: entries to take (None: every trackable that is not an optimizer).
      exclude: entries left at their initial values.
      replicator: assigns inside its scope (every replica's copy).

    Returns:
      {"path", "restored": [names], "excluded", "not_selected", "not_in_checkpoint"}.

    Raises:
      ConfigError: no checkpoint, an entry that matches nothing, or a shape that differs.
    """
    path = source_path(source)
    live = live_variables(trackables)
    keys = _keys(trackables, path)
    shared = sorted(n for n, v in live.items() if id(v) in keys)
    if not shared:
        raise ConfigError(f"{_BINDING}={source!r}: the checkpoint {path} holds none of this task's variables "
                          f"({', '.join(sorted(trackables))}).")
    if include is None:
        include = [top for top, obj in trackables.items() if not _is_optimizer(obj)]
    else:
        _check_entries("run_experiment.init_include", include, shared)
    _check_entries("run_experiment.init_exclude", exclude, shared)
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    report = collections.defaultdict(list)
    chosen = []
    for name, variable in sorted(live.items()):
        if id(variable) not in keys:
            report["not_in_checkpoint"].append(name)
        elif not _selected(name, include):
            report["not_selected"].append(name)
        elif _selected(name, exclude):
            report["excluded"].append(name)
        else:
            saved, now = tuple(shapes[keys[id(variable)]]), tuple(variable.shape)
            if saved != now:
                raise ConfigError(f"{_BINDING}: {name} has shape {saved} in {path} and {now} in this task; add it "
                                  f"(or its layer) to run_experiment.init_exclude to leave it at its initial value.")
            chosen.append((name, variable))
    with replicator.scope() if replicator is not None else contextlib.nullcontext():
        for name, variable in chosen:
            variable.assign(reader.get_tensor(keys[id(variable)]))
            report["restored"].append(name)
    return {"path": path, **{k: report[k] for k in ("restored", "excluded", "not_selected", "not_in_checkpoint")}}


def summary(report: Dict[str, object]) -> str:
    """The start's line: what was restored from where, and what was not, and why."""
    def grouped(names: List[str]) -> str:
        counts = collections.Counter(n.split("/")[0] for n in names)
        return ", ".join(f"{top} {n}" for top, n in sorted(counts.items()))

    parts = [f"init_checkpoint: restored {len(report['restored'])} variable(s) from {report['path']} "
             f"({grouped(report['restored'])})"]
    why = {"excluded": "excluded by run_experiment.init_exclude", "not_selected": "not in run_experiment.init_include",
           "not_in_checkpoint": "not in the checkpoint"}
    left = []
    for key, text in why.items():
        if report[key]:
            shown = ": " + ", ".join(report[key][:3]) if key == "excluded" else ""
            left.append(f"{len(report[key])} {text} ({grouped(report[key])}{shown})")
    parts.append("left at initial values: " + ("; ".join(left) if left else "none"))
    return "; ".join(parts)
