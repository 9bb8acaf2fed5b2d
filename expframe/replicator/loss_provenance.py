"""What a step's loss was built from: the two porting traps that tracing can see, for
`ReplicatedOptimizer.apply_gradients` to refuse while the step is traced.

1. A loss already divided across replicas. expframe's loss convention is that each
   replica's loss is the mean over its own batch, and `wrap_optimizer` averages the
   gradients over replicas. Code written for a bare `tf.distribute` loop, where Keras
   sums the gradients, divides by the replicas itself (TensorFlow's tutorial "Custom
   training with tf.distribute.Strategy"): pasted into a step, every gradient is
   divided by N twice. Seen while tracing, in a replica context:
     * a call of `tf.nn.compute_average_loss` or `tf.nn.scale_regularization_loss`;
     * a read of `num_replicas_in_sync` (of a replica context or a strategy) by the
       step's own code: reads by TensorFlow, by Keras and by this package (collectives,
       input pipelines) do not count, nor do reads of a `tf.distribute.InputContext`
       (an input_fn's batch size), which is another class;
     * a Keras loss object with reduction 'sum_over_batch_size' (Keras' default):
       in a replica context Keras divides its mean by the replicas
       (`keras.src.losses.loss.scale_loss_for_distribution`), for `fit`'s summed
       gradients.
   A division by a plain number cannot be told apart, and is not looked for.
2. A model's regularisation losses left out. Keras collects a model's
   `kernel_regularizer=...` terms (and `add_loss`, e.g. activity regularizers) in
   `model.losses`, and nothing adds them unless the step does. A trainable variable
   updated by the optimizer that has a regularizer, or a layer holding such a
   variable that called `add_loss` in the step, must have had `.losses` read, of it
   or of a model containing it, inside the step.

How: this module wraps those two functions and three properties (`num_replicas_in_sync`
of replica contexts and of strategies, `keras.layers.Layer.losses`) and
`Layer.add_loss` when it is imported. The wrappers only record, and only while a
tf.function is traced: each event goes to the graph being built and to every graph
around it (a nested tf.function, a loop body), weakly keyed, so `check` finds what the
step did from the graph that calls `apply_gradients`. Eager code records nothing, and
costs one `tf.executing_eagerly()` per call. Import fails on a TensorFlow or Keras
without the wrapped names (a silent no-op is the worst failure a check can have).
"""

import functools
import os
import sys
import threading
import weakref
from typing import Callable, List, Sequence, Tuple

import keras
import tensorflow as tf
from keras.src.losses import loss as keras_loss_module

from expframe.errors import ConfigError

# The releases this was written for and tested with (the pins in pyproject.toml).
SUPPORTED = "tensorflow>=2.21,<2.22 and keras>=3.15,<3.16"
_DIVIDING_FUNCTIONS = ("compute_average_loss", "scale_regularization_loss")
_KERAS_SCALE = "scale_loss_for_distribution"  # Keras' division of a loss by the replicas
_LIBRARIES = ("tensorflow", "keras", "tf_keras")
_THIS_PACKAGE = __name__.rsplit(".", 1)[0]  # expframe.replicator


class HookError(ImportError):
    """The installed TensorFlow or Keras lacks a name that this module wraps."""


class _Record:
    """What one graph's tracing saw (see module docstring)."""

    def __init__(self):
        self.divisions: List[Tuple[str, str]] = []  # (what, where), in order
        self.covered: set = set()               # ids of variables whose layer's .losses was read
        self.adders: List[weakref.ref] = []     # layers that called add_loss


_RECORDS: "weakref.WeakKeyDictionary[tf.Graph, _Record]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _graphs(graph: tf.Graph):
    """`graph` and the function graphs around it (each FuncGraph's outer_graph), up to
    the outermost tf.function: not the process's global graph, which every top-level
    tf.function has as its outer graph, and which would mix up all steps."""
    while graph is not None and hasattr(graph, "outer_graph"):
        yield graph
        graph = graph.outer_graph


def _record(update: Callable[[_Record], None]) -> None:
    graph = tf.compat.v1.get_default_graph()
    with _LOCK:
        for g in _graphs(graph):
            update(_RECORDS.setdefault(g, _Record()))


def _tracing_in_replica() -> bool:
    return not tf.executing_eagerly() and tf.distribute.get_replica_context() is not None


# -- frames: whose code did it --------------------------------------------------------

def _module(frame) -> str:
    # AutoGraph's converted copy of a function keeps its module's globals.
    return frame.f_globals.get("__name__", "") or ""


def _is_library(frame) -> bool:
    return _module(frame).split(".", 1)[0] in _LIBRARIES


def _is_ours(frame) -> bool:
    return _module(frame) == _THIS_PACKAGE or _module(frame).startswith(_THIS_PACKAGE + ".")


def _user_frame(frame):
    """The first frame from `frame` outwards that is neither TensorFlow's nor Keras'."""
    while frame is not None and _is_library(frame):
        frame = frame.f_back
    return frame


def _site(frame) -> str:
    """`Owner.function (path:line)`; for AutoGraph's copy of a function, which runs from a
    generated file, `Owner.function (path)` of the original."""
    generated = "__autograph_generated" in frame.f_code.co_filename
    named = frame
    if generated:  # AutoGraph cuts control flow into inner functions of `tf__<name>`
        outer = frame
        while outer is not None and not outer.f_code.co_name.startswith("tf__") and (
                _is_library(outer) or "__autograph_generated" in outer.f_code.co_filename):
            outer = outer.f_back
        named = outer if outer is not None and outer.f_code.co_name.startswith("tf__") else frame
    name = named.f_code.co_name
    name = name[len("tf__"):] if generated and name.startswith("tf__") else name
    owner = named.f_locals.get("self")
    where = f"{type(owner).__name__}.{name}" if owner is not None else name
    module = sys.modules.get(_module(frame))
    path = getattr(module, "__file__", None) if generated else frame.f_code.co_filename
    if not path:
        return where
    try:
        path = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        pass
    return f"{where} ({path})" if generated else f"{where} ({path}:{frame.f_lineno})"


def _note_division(what: str, frame) -> None:
    if frame is None or _is_ours(frame):
        return
    site = (what, _site(frame))
    _record(lambda r: r.divisions.append(site))


# -- the wrappers -------------------------------------------------------------------

def _dividing_function(original: Callable, name: str) -> Callable:
    @functools.wraps(original)  # keeps TensorFlow's module: AutoGraph calls it unconverted
    def wrapper(*args, **kwargs):
        if _tracing_in_replica():
            _note_division(f"calls tf.nn.{name}", _user_frame(sys._getframe(1)))  # pylint: disable=protected-access
        return original(*args, **kwargs)
    wrapper.__expframe_wrapped__ = original
    return wrapper


def _counting_replicas(prop: property) -> property:
    def read(self):
        if _tracing_in_replica():
            reader = sys._getframe(1)  # pylint: disable=protected-access
            if reader.f_code.co_name == _KERAS_SCALE and _module(reader).startswith("keras"):
                _note_division("calls a Keras loss object with reduction 'sum_over_batch_size' (Keras divides its "
                               "mean by the replicas)", _user_frame(reader))
            elif not _is_library(reader):
                _note_division("reads num_replicas_in_sync", reader)
        return prop.fget(self)
    return property(read, prop.fset, prop.fdel, prop.__doc__)


def _counting_losses(prop: property) -> property:
    def read(self):
        if not tf.executing_eagerly():
            ids = {id(v) for v in self.trainable_weights}
            _record(lambda r: r.covered.update(ids))
        return prop.fget(self)
    return property(read, prop.fset, prop.fdel, prop.__doc__)


def _recording_add_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_loss(self, loss):
        out = original(self, loss)
        if not tf.executing_eagerly():
            layer = weakref.ref(self)
            _record(lambda r: r.adders.append(layer))
        return out
    return add_loss


def _defining_class(cls: type, name: str) -> type:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    raise HookError(f"expframe's porting checks wrap {cls.__module__}.{cls.__qualname__}.{name}, which this "
                    f"release does not have; expframe supports {SUPPORTED}.")


def _subclasses(cls: type) -> List[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def install() -> None:
    """Wraps the names of the module docstring (once); HookError if one is missing or is
    not what is expected."""
    for name in _DIVIDING_FUNCTIONS:
        function = getattr(tf.nn, name, None)
        if not callable(function):
            raise HookError(f"expframe's porting checks wrap tf.nn.{name}, which TensorFlow {tf.__version__} does "
                            f"not have; expframe supports {SUPPORTED}.")
        if not hasattr(function, "__expframe_wrapped__"):
            setattr(tf.nn, name, _dividing_function(function, name))
    scale = getattr(keras_loss_module, _KERAS_SCALE, None)
    code = getattr(scale, "__code__", None)
    if code is None or "num_replicas_in_sync" not in code.co_names or \
            _KERAS_SCALE not in keras_loss_module.reduce_values.__code__.co_names:
        raise HookError(f"expframe's porting checks recognise Keras' division of a loss by the replicas by "
                        f"keras.src.losses.loss.{_KERAS_SCALE}, which Keras {keras.__version__} no longer has or "
                        f"calls; expframe supports {SUPPORTED}.")
    wraps = [(base, "num_replicas_in_sync", _counting_replicas) for base in (
        _defining_class(tf.distribute.ReplicaContext, "num_replicas_in_sync"),
        _defining_class(tf.distribute.Strategy, "num_replicas_in_sync"))]
    wraps.append((_defining_class(keras.layers.Layer, "losses"), "losses", _counting_losses))
    for base, name, wrap in wraps:
        for cls in _subclasses(base):  # a subclass that overrides it is wrapped too
            prop = vars(cls).get(name)
            if prop is None:
                continue
            if not isinstance(prop, property):
                raise HookError(f"expframe's porting checks wrap the property {cls.__qualname__}.{name}, which is "
                                f"not a property in this release; expframe supports {SUPPORTED}.")
            if not getattr(prop.fget, "__expframe_wrapped__", False):
                wrapped = wrap(prop)
                wrapped.fget.__expframe_wrapped__ = True
                setattr(cls, name, wrapped)
    layer = _defining_class(keras.layers.Layer, "add_loss")
    if not getattr(layer.add_loss, "__expframe_wrapped__", False):
        layer.add_loss = _recording_add_loss(layer.add_loss)
        layer.add_loss.__expframe_wrapped__ = True


install()


# -- the check ---------------------------------------------------------------------

def _seen() -> _Record:
    """What the graphs around the current one recorded, merged."""
    merged = _Record()
    with _LOCK:
        for g in _graphs(tf.compat.v1.get_default_graph()):
            record = _RECORDS.get(g)
            if record is not None:
                merged.divisions += record.divisions
                merged.covered |= record.covered
                merged.adders += record.adders
    return merged


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def _unread_losses(seen: _Record, variables: Sequence) -> List[str]:
    """What of `variables` carries a regularisation loss that the step never read."""
    unread = [f"the regularizer of {_name(v)}" for v in variables
              if getattr(v, "regularizer", None) is not None and id(v) not in seen.covered]
    applied = {id(v) for v in variables}
    for ref in seen.adders:
        layer = ref()
        ids = {id(w) for w in getattr(layer, "trainable_weights", ())}
        if layer is not None and ids & applied and not ids <= seen.covered:
            what = f"the add_loss of layer {layer.name!r}"
            if what not in unread:
                unread.append(what)
    return unread


def _listed(items: Sequence[str], most: int = 2) -> str:
    items = list(dict.fromkeys(items))  # once each (every replica traces the step)
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return " and ".join(items[:most]) + more


def _divisions(divisions: Sequence[Tuple[str, str]]) -> str:
    """'calls X and reads Y in Task.step (file)', per place, in the order seen."""
    by_site: dict = {}
    for what, where in divisions:
        by_site.setdefault(where, []).append(what)
    return "; ".join(f"{_listed(whats, 3)} in {where}" for where, whats in by_site.items())


@tf.autograph.experimental.do_not_convert
def check(variables: Sequence, step: Callable[[], str], allow_divided_loss: bool,
          allow_unread_model_losses: bool) -> None:
    """Raises, while a step is traced, a ConfigError for either trap that the step's
    tracing recorded (module docstring); eagerly nothing is recorded or checked.

    Args:
      variables: the variables the optimizer updates.
      step: names the user's step (called only to word an error).
      allow_divided_loss: `wrap_optimizer.allow_divided_loss`.
      allow_unread_model_losses: `wrap_optimizer.allow_unread_model_losses`.

    Raises:
      ConfigError: one line, naming the step, what was seen and the fix.
    """
    if tf.executing_eagerly():
        return
    seen = _seen()
    error = None
    if seen.divisions and not allow_divided_loss:
        error = ConfigError(
            f"{step()} divides its loss across replicas ({_divisions(seen.divisions)}), but wrap_optimizer already "
            f"averages the gradients over replicas (expframe's loss convention: each replica's loss is the mean "
            f"over its own batch), so at N replicas every gradient would be divided by N again; write the loss as "
            f"tf.reduce_mean(per_example_loss) (a Keras loss object with reduction=None, or its function form) "
            f"plus tf.add_n(model.losses) unscaled, or bind wrap_optimizer.allow_divided_loss = True if the "
            f"division is deliberate (docs/extending.md).")
    elif not allow_unread_model_losses:
        unread = _unread_losses(seen, variables)
        if unread:
            error = ConfigError(
                f"{step()} never reads the model's regularisation losses ({_listed(unread)}: model.losses), so "
                f"they would not be trained; add them to the loss, loss = tf.reduce_mean(per_example_loss) + "
                f"tf.add_n(model.losses) (unscaled: wrap_optimizer averages over replicas), or bind "
                f"wrap_optimizer.allow_unread_model_losses = True if leaving them out is deliberate "
                f"(docs/extending.md).")
    if error is not None:
        error.ag_pass_through = True  # AutoGraph would wrap it in a StagingError of several lines
        raise error

