"""Export for serving: a task's signatures as a TensorFlow SavedModel (`--mode=export`).

After Model Garden's `export_base.ExportModule`: each task gives its serving functions
(`Task.serving`: tf.functions with an input signature, returning dicts of named
tensors); this module traces them, tracks exactly the variables they read, and writes
them with `tf.saved_model.save`. The SavedModel needs neither expframe nor a replicator
to load: `tf.saved_model.load(export_dir).signatures["serving_default"](**inputs)`.

The export is written whole or not at all: into a hidden sibling folder of
`export_dir`, renamed to `export_dir` once complete. An `export_dir` that exists and
is not empty is refused (ConfigError), so an export never mixes with another; one that
exists empty is replaced. Variables laid out on a DTensor mesh are refused: a SavedModel
of them loads only on that mesh (`No OpKernel ... Relayout`); a mesh task serves
unsharded copies (`MeshClassificationTask.serving`).

Example:
    from expframe import export
    info = export.export_saved_model(task, "runs/quickstart/export")
    info["signatures"]["serving_default"]["outputs"]   # ['logits', 'probabilities', ...]
"""

import os
import secrets
import shutil
from typing import Any, Dict, List

import tensorflow as tf
from tensorflow.experimental import dtensor

from expframe.errors import ConfigError
from expframe.tasks.base import Task

DEFAULT_SIGNATURE = "serving_default"

ConcreteFunctions = Dict[str, tf.types.experimental.ConcreteFunction]


def _check_destination(export_dir: str) -> None:
    """ConfigError unless `export_dir` is absent or an empty folder."""
    if os.path.isdir(export_dir) and os.listdir(export_dir):
        raise ConfigError(f"--export_dir={export_dir} exists and is not empty: export into a new folder "
                          "(or remove this one).")
    if os.path.exists(export_dir) and not os.path.isdir(export_dir):
        raise ConfigError(f"--export_dir={export_dir} is a file, not a folder: export into a new folder.")


def _signatures(task: Task) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
    """The task's serving functions (`Task.serving`); ConfigError naming the contract for
    anything else."""
    name = type(task).__name__
    signatures = task.serving()
    if not isinstance(signatures, dict) or DEFAULT_SIGNATURE not in signatures:
        raise ConfigError(f"{name}.serving must return a dict of signatures holding {DEFAULT_SIGNATURE!r} "
                          "(docs/extending.md).")
    for key, fn in signatures.items():
        if getattr(fn, "input_signature", None) is None:
            raise ConfigError(f"{name}.serving()[{key!r}] is not a tf.function with an input_signature "
                              "(docs/extending.md).")
    return signatures


def _trace(task: Task, signatures: Dict[str, tf.types.experimental.PolymorphicFunction]) -> ConcreteFunctions:
    """Each signature traced once; ConfigError unless it returns a dict of named tensors.
    (The traces hold their variables weakly: keep `signatures` alive while they are used.)"""
    traced = {key: fn.get_concrete_function() for key, fn in signatures.items()}
    for key, function in traced.items():
        outputs = function.structured_outputs
        if not isinstance(outputs, dict) or not all(isinstance(k, str) for k in outputs):
            raise ConfigError(f"{type(task).__name__}.serving()[{key!r}] returns {type(outputs).__name__}, not a "
                              "dict of named tensors (docs/extending.md).")
    return traced


def _variables(task: Task, traced: ConcreteFunctions) -> List[tf.Variable]:
    """The variables the traced functions read, once each; ConfigError for DTensor ones."""
    found = {}
    for key, function in traced.items():
        for v in function.variables:
            if isinstance(v, dtensor.DVariable):
                raise ConfigError(f"{type(task).__name__}.serving()[{key!r}] reads the DTensor variable {v.name!r}, "
                                  "which loads only on its mesh: serve plain copies of the values instead.")
            found.setdefault(id(v), v)
    return list(found.values())


def describe(function: tf.types.experimental.ConcreteFunction) -> Dict[str, Any]:
    """{"inputs": {name: {"dtype", "shape"}}, "outputs": [names]} of a traced signature
    (JSON-ready: an unknown dimension is None)."""
    specs = tf.nest.flatten(function.structured_input_signature)
    return {"inputs": {s.name: {"dtype": s.dtype.name, "shape": s.shape.as_list()} for s in specs},
            "outputs": sorted(function.structured_outputs)}


def _save(traced: ConcreteFunctions, variables: List[tf.Variable], folder: str) -> None:
    root = tf.Module()
    root.serving_variables = variables  # tracked, so the functions' captures are saved
    tf.saved_model.save(root, folder, signatures=traced)


def export_saved_model(task: Task, export_dir: str) -> Dict[str, Any]:
    """Writes `task.serving()`'s signatures, on the task's current weights, as a SavedModel.

    Args:
      task: a built task whose weights were restored (its `serving` hook is called here).
      export_dir: the SavedModel's folder: must not exist, or be empty; its parent is
        created if needed.

    Returns:
      {"export_dir": absolute path, "signatures": {name: describe(signature)}}.

    Raises:
      ConfigError: a non-empty export_dir, a task without serving signatures, or
        signatures that break the contract (docs/extending.md).
    """
    export_dir = os.path.abspath(export_dir)
    _check_destination(export_dir)
    signatures = _signatures(task)  # holds what the traces read (their variables) until saved
    traced = _trace(task, signatures)
    variables = _variables(task, traced)
    parent = os.path.dirname(export_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_{os.path.basename(export_dir)}.{os.getpid()}.{secrets.token_hex(4)}")
    os.mkdir(tmp)  # the permissions a plain mkdir gives (mkdtemp's are the owner's only)
    try:
        _save(traced, variables, tmp)
        _check_destination(export_dir)  # still free: nothing else wrote it meanwhile
        try:
            os.replace(tmp, export_dir)  # an empty folder is replaced; a non-empty one refuses
        except OSError as e:
            raise ConfigError(f"--export_dir={export_dir}: the export could not be moved into place ({e}).") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"export_dir": export_dir, "signatures": {k: describe(f) for k, f in sorted(traced.items())}}
