"""Export for serving: a task's signatures as a TensorFlow SavedModel (`--mode=export`).

After Model Garden's `export_base.ExportModule`: each task gives its serving functions
(`Task.serving`: tf.functions with an input signature, returning dicts of named
tensors); this module traces them, tracks exactly the variables they read, and writes
them with `tf.saved_model.save`. The SavedModel needs neither expframe nor a replicator
to load: `tf.saved_model.load(export_dir).signatures["serving_default"](**inputs)`.
Beside the signatures go the task's files (`Task.serving_assets`, e.g. a classifier's
`assets/labels.txt`) and, where the task's model is a Keras model (`Task.keras_model`),
`model.keras`: a copy in plain Keras layers that `keras.models.load_model` reads without
expframe (expframe/keras_copy.py).

The export is written whole or not at all: into a hidden sibling folder of
`export_dir`, renamed to `export_dir` once complete (`model.keras` included). An
`export_dir` that exists and is not empty is refused (ConfigError), so an export never
mixes with another; one that exists empty is replaced. Variables laid out on a DTensor
mesh are refused: a SavedModel of them loads only on that mesh (`No OpKernel ...
Relayout`); a mesh task serves unsharded copies (`MeshClassificationTask.serving`).

What an export reads from a checkpoint (`restorable`): the task's trackables but their
optimizers, whose state serves nothing and depends on the precision. Under
`--export_precision=mixed_float16`, `wrap_optimizer` adds dynamic loss scaling (a scale,
a count of good steps, and, as the update is deferred, a gradient accumulator per
variable and a micro-step count) and Keras' `compile` wraps a model's optimizer in a
`LossScaleOptimizer`: state that a float32 or bfloat16 run's checkpoint does not hold,
and the other way round.

Example:
    from expframe import export
    info = export.export_saved_model(task, "runs/quickstart/export")
    info["signatures"]["serving_default"]["outputs"]   # ['logits', 'probabilities', ...]
"""

import os
import secrets
import shutil
import tempfile
from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from expframe import keras_copy
from expframe.errors import ConfigError, RunError
from expframe.replicator import ReplicatedOptimizer
from expframe.replicator.mesh_optimizer import MeshAdam
from expframe.tasks.base import Task

DEFAULT_SIGNATURE = "serving_default"
KERAS_FILE = "model.keras"
_OPTIMIZERS = (keras.optimizers.Optimizer, ReplicatedOptimizer, MeshAdam)

ConcreteFunctions = Dict[str, tf.types.experimental.ConcreteFunction]


def restorable(task: Task, step: tf.Variable) -> Dict[str, Any]:
    """What an export reads from a checkpoint, as the children of a checkpoint's root
    (`checkpointer.read_checkpoint`): `step` and the task's trackables, less their
    optimizers wherever they are (a compiled Keras model holds its own). Every object of it
    must be in the checkpoint; an optimizer's state need not (module docstring).

    Objects that hold an optimizer are stood in for by containers (`tf.train.Checkpoint`s)
    of their other children, under the same names, so the rest matches the checkpoint's
    object graph as before (a stand-in reads no values of its own: a Keras model, the one
    such holder here, keeps all of them in its children)."""
    root = tf.train.Checkpoint(step=step, **task.trackables())
    view, memo = tf.train.TrackableView(root), {}
    return {name: _without_optimizers(child, view, memo) for name, child in view.children(root).items()
            if not isinstance(child, _OPTIMIZERS)}


def _without_optimizers(obj: Any, view: tf.train.TrackableView, memo: Dict[int, Any]) -> Any:
    """`obj` itself when no optimizer is among its descendants, else a container of its
    children (each likewise) but the optimizers. Shared objects keep one stand-in."""
    if id(obj) in memo:
        return memo[id(obj)]
    memo[id(obj)] = obj  # a cycle back to it keeps the object
    children = view.children(obj)
    kept = {name: _without_optimizers(child, view, memo) for name, child in children.items()
            if not isinstance(child, _OPTIMIZERS)}
    if len(kept) < len(children) or any(kept[name] is not children[name] for name in kept):
        memo[id(obj)] = tf.train.Checkpoint(**kept)
    return memo[id(obj)]


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


def _assets(task: Task) -> Dict[str, str]:
    """`task.serving_assets()`, checked: {plain file name: text}."""
    assets = task.serving_assets()
    for name, text in assets.items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") \
                or not isinstance(text, str):
            raise ConfigError(f"{type(task).__name__}.serving_assets() must map plain file names to text; got "
                              f"{name!r}: {type(text).__name__} (docs/extending.md).")
    return assets


def describe(function: tf.types.experimental.ConcreteFunction) -> Dict[str, Any]:
    """{"inputs": {name: {"dtype", "shape"}}, "outputs": [names]} of a traced signature
    (JSON-ready: an unknown dimension is None)."""
    specs = tf.nest.flatten(function.structured_input_signature)
    return {"inputs": {s.name: {"dtype": s.dtype.name, "shape": s.shape.as_list()} for s in specs},
            "outputs": sorted(function.structured_outputs)}


def _save(traced: ConcreteFunctions, variables: List[tf.Variable], assets: Dict[str, str], folder: str) -> None:
    root = tf.Module()
    root.serving_variables = variables  # tracked, so the functions' captures are saved
    with tempfile.TemporaryDirectory() as sources:
        files = {}
        for name, text in assets.items():
            files[name] = os.path.join(sources, name)
            with open(files[name], "w", encoding="utf-8") as f:
                f.write(text)
        if files:  # copied into <folder>/assets/<name>; a loaded model has `assets[name].asset_path`
            root.assets = {name: tf.saved_model.Asset(path) for name, path in files.items()}
        tf.saved_model.save(root, folder, signatures=traced)


def _keras_copy(task: Task, folder: str) -> Optional[str]:
    """Writes `model.keras` into `folder` where the task has a Keras model with a plain copy;
    None when written, else why not (one line, also printed)."""
    model = task.keras_model()
    if model is None:
        return f"{type(task).__name__} declares no Keras model (Task.keras_model)"
    path = os.path.join(folder, KERAS_FILE)
    try:
        keras_copy.plain_copy(model).save(path)
    except (keras_copy.NoPlainCopy, ValueError, TypeError, NotImplementedError) as e:  # not OSError: a full disk
        why = str(e) if isinstance(e, keras_copy.NoPlainCopy) else f"Keras could not save it ({_first_line(e)})"
        if os.path.exists(path):
            os.remove(path)
        print(f"export: no {KERAS_FILE} beside the SavedModel: {why}", flush=True)
        return why
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else 'no message'}"


def export_saved_model(task: Task, export_dir: str) -> Dict[str, Any]:
    """Writes `task.serving()`'s signatures, on the task's current weights, as a SavedModel,
    with the task's assets and, where it has one, its Keras model as `model.keras`.

    Args:
      task: a built task whose weights were restored (its `serving` hook is called here).
      export_dir: the SavedModel's folder: must not exist, or be empty; its parent is
        created if needed.

    Returns:
      {"export_dir": absolute path, "signatures": {name: describe(signature)}, "assets":
      [file names under assets/], "keras_model": the `model.keras` path or None,
      "no_keras_model": None or why there is none}.

    Raises:
      ConfigError: a non-empty export_dir, a task without serving signatures, or
        signatures or assets that break the contract (docs/extending.md).
      RunError: the files could not be written (e.g. a full disk); nothing is left.
    """
    export_dir = os.path.abspath(export_dir)
    _check_destination(export_dir)
    signatures = _signatures(task)  # holds what the traces read (their variables) until saved
    traced = _trace(task, signatures)
    variables = _variables(task, traced)
    assets = _assets(task)
    parent = os.path.dirname(export_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_{os.path.basename(export_dir)}.{os.getpid()}.{secrets.token_hex(4)}")
    os.mkdir(tmp)  # the permissions a plain mkdir gives (mkdtemp's are the owner's only)
    try:
        try:
            _save(traced, variables, assets, tmp)
            no_keras = _keras_copy(task, tmp)
        except (OSError, tf.errors.OpError) as e:  # a full disk, a folder taken away
            raise RunError(f"--export_dir={export_dir}: the export could not be written ({_first_line(e)}); "
                           "nothing was left there.") from None
        _check_destination(export_dir)  # still free: nothing else wrote it meanwhile
        try:
            os.replace(tmp, export_dir)  # an empty folder is replaced; a non-empty one refuses
        except OSError as e:
            raise ConfigError(f"--export_dir={export_dir}: the export could not be moved into place ({e}).") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"export_dir": export_dir, "signatures": {k: describe(f) for k, f in sorted(traced.items())},
            "assets": sorted(assets), "keras_model": None if no_keras else os.path.join(export_dir, KERAS_FILE),
            "no_keras_model": no_keras}
