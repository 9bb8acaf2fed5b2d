"""A plain Keras copy of a model for `--mode=export`: `model.keras`, loadable without expframe.

Keras 3 loads only `.keras` files (`keras.models.load_model`), and a `.keras` file names
each layer's class: one that holds an expframe layer loads only where expframe is
installed. The export therefore writes a copy in which each expframe layer is replaced
by plain Keras layers that compute the same at inference (training=False), with the
same weights:

- `SyncBatchNorm` -> `keras.layers.BatchNormalization`: at inference both normalise with
  the moving statistics; only training's moments differ (global batch, local batch).
- `ZeroPadShortcut` (CIFAR ResNets) -> `MaxPooling2D(1, strides)`, `Reshape`,
  `ZeroPadding3D`, `Reshape`: every s-th pixel and zero channels, exactly.

A model with another expframe layer (spectral norm, conditional batch norm, the GAN's
blocks) gets no copy: `plain_copy` says which layer stopped it. Layers of other packages
(the user's own) stay as they are; the copy then loads where their package is. A
subclassed model, or a layer that Keras cannot rebuild from its config, gets no copy
(Keras' `clone_model` says why). Each copy is checked
against the model on random inputs before it is written.

Example:
    copy = keras_copy.plain_copy(model)      # raises NoPlainCopy with the reason
    copy.save("export/model.keras")          # loads with keras.models.load_model alone
"""

from typing import Callable, Dict, List, Optional

import keras
import numpy as np

from expframe.layers.sync_batch_norm import SyncBatchNorm
from expframe.models.resnet import ZeroPadShortcut

#: The largest difference allowed between the copy and the model on the check's inputs.
ATOL = 1e-5


class NoPlainCopy(Exception):
    """The model has no plain Keras copy; the message says why (one line)."""


def _batch_norm(layer: SyncBatchNorm) -> keras.layers.Layer:
    config = layer.get_config()
    config.pop("group_size", None)
    config["synchronized"] = False
    return keras.layers.BatchNormalization.from_config(config)


def _zero_pad_shortcut(layer: ZeroPadShortcut) -> keras.layers.Layer:
    """x[:, ::s, ::s, :], channels zero-padded (extra // 2 before, the rest after), as
    `ZeroPadShortcut.call`: a max-pool of size 1 takes every s-th pixel, and ZeroPadding3D
    pads the channels of the image seen as a volume [H, W, C, 1]."""
    height, width, channels = layer.input.shape[1:]
    if height is None or width is None or channels is None:
        raise NoPlainCopy(f"layer {layer.name!r} (ZeroPadShortcut) has an input of unknown size {layer.input.shape}")
    stride = layer.strides
    height, width = -(-height // stride), -(-width // stride)
    extra = layer.filters - channels
    policy = layer.dtype_policy
    return keras.Sequential([
        keras.layers.MaxPooling2D(pool_size=1, strides=stride, dtype=policy, name="subsample"),
        keras.layers.Reshape((height, width, channels, 1), dtype=policy, name="as_volume"),
        keras.layers.ZeroPadding3D(((0, 0), (0, 0), (extra // 2, extra - extra // 2)), dtype=policy,
                                   name="pad_channels"),
        keras.layers.Reshape((height, width, layer.filters), dtype=policy, name="as_image"),
    ], name=layer.name)


#: expframe's layer classes with a plain Keras equivalent at inference.
CONVERSIONS: Dict[type, Callable[[keras.layers.Layer], keras.layers.Layer]] = {
    SyncBatchNorm: _batch_norm,
    ZeroPadShortcut: _zero_pad_shortcut,
}


def _from_expframe(layer: keras.layers.Layer) -> bool:
    return type(layer).__module__.split(".")[0] == "expframe"


def _clone_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
    convert = CONVERSIONS.get(type(layer))
    if convert is not None:
        return convert(layer)
    if _from_expframe(layer):
        raise NoPlainCopy(f"layer {layer.name!r} ({type(layer).__name__}) has no plain Keras equivalent")
    return layer.__class__.from_config(layer.get_config())


def _layers(model: keras.Model) -> List[keras.layers.Layer]:
    """Every layer of the model, nested ones included (not the model itself)."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)]  # pylint: disable=protected-access


def _check(model: keras.Model, copy: keras.Model) -> Optional[float]:
    """The largest difference between the model's and the copy's outputs (training=False)
    on two random inputs, or None where an input's shape is not fully known."""
    shapes = [tuple(t.shape[1:]) for t in model.inputs]
    if any(None in shape for shape in shapes):
        return None
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=(2, *shape)).astype(t.dtype) for shape, t in zip(shapes, model.inputs, strict=True)]
    inputs = inputs[0] if len(inputs) == 1 else inputs
    want = keras.tree.flatten(model(inputs, training=False))
    got = keras.tree.flatten(copy(inputs, training=False))
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(want, got, strict=True))


def plain_copy(model: keras.Model) -> keras.Model:
    """A copy of `model` without expframe's layers (module docstring), holding its weights.

    Args:
      model: a functional or Sequential Keras model.

    Returns:
      The copy: same inputs, outputs, layer names, dtype policies and weights.

    Raises:
      NoPlainCopy: a subclassed model, a layer Keras cannot rebuild from its config, an
        expframe layer without an equivalent, or a copy whose outputs differ from the
        model's by more than ATOL.
    """
    if not isinstance(model, keras.Model):
        raise NoPlainCopy(f"the model is a {type(model).__name__}, not a keras.Model")
    try:
        copy = keras.models.clone_model(model, clone_function=_clone_layer, recursive=True)
    except (ValueError, TypeError, NotImplementedError) as e:
        # Keras clones only functional and Sequential models, and layers its config rebuilds.
        raise NoPlainCopy(f"Keras could not copy the {type(model).__name__} model's layers "
                          f"({type(e).__name__}: {str(e).strip().splitlines()[0]})") from None
    left = next((layer for layer in _layers(copy) if _from_expframe(layer)), None)
    if left is not None:  # inside a layer of another package, which rebuilt it
        raise NoPlainCopy(f"layer {left.name!r} ({type(left).__name__}) has no plain Keras equivalent")
    try:
        copy.set_weights(model.get_weights())
    except ValueError as e:
        raise NoPlainCopy(f"the copy's weights do not match the model's ({str(e).splitlines()[0]})") from None
    worst = _check(model, copy)
    if worst is not None and not worst <= ATOL:
        raise NoPlainCopy(f"the copy's outputs differ from the model's by {worst:.3g} (more than {ATOL})")
    return copy
