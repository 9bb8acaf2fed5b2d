"""What a dataset's eval pipeline does to one raw image: for an export to do it inside the
SavedModel, so a server can send the images it has (uint8 pixels or encoded bytes).

A dataset function (the `ClassificationTask.dataset` contract: `fn(split, ctx,
batch_size, training, seed, deterministic)`) declares it with `declare`, after gin has
made it configurable; `of(dataset_fn)` returns it, on the dataset's gin bindings of the
moment (image size, standardization, dtype), or None for a dataset that declares none.
`shapes_input` and `imagenet_input` declare theirs (expframe/data/inputs.py, imagenet.py).

Example:
    raw = raw_images.of(shapes_input)            # shapes_input's bindings: size, standardize
    raw.preprocess(uint8_image)                  # float32 [32, 32, 3], as its eval pipeline
    raw.decode(png_or_jpeg_bytes)                # the same from encoded bytes
    raw.class_names                              # ('circle', 'square', ...)
"""

import dataclasses
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import gin
import tensorflow as tf

#: The attribute of a dataset function that holds its declaration.
ATTRIBUTE = "raw_images"


@dataclasses.dataclass(frozen=True)
class RawImages:
    """How one raw image becomes the model's input in a dataset's eval pipeline.

    Attributes:
      preprocess: uint8 [H, W, 3] of any size -> float32 [h, w, c], exactly the image the
        eval pipeline feeds the model for it (graph-mode TensorFlow ops only).
      decode: scalar string, an encoded image (JPEG, PNG, GIF or BMP) -> the same.
      class_names: the name of each label, in label order, or None where unknown.
    """

    preprocess: Callable[[tf.Tensor], tf.Tensor]
    decode: Callable[[tf.Tensor], tf.Tensor]
    class_names: Optional[Tuple[str, ...]]


def decode_image(encoded: tf.Tensor) -> tf.Tensor:
    """An encoded image (JPEG, PNG, GIF's first frame or BMP) as uint8 [H, W, 3]; a
    grayscale image's channel repeated, an alpha channel dropped."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False, dtype=tf.uint8)
    image.set_shape([None, None, 3])
    return image


def bound_arguments(fn: Callable) -> Dict[str, Any]:
    """fn's keyword arguments as a call through gin now gets them: gin's bindings of fn
    over the defaults of its signature (arguments without a default are left out)."""
    values = {name: p.default for name, p in inspect.signature(fn).parameters.items()
              if p.default is not inspect.Parameter.empty}
    try:
        values.update(gin.get_bindings(fn))
    except ValueError:  # not a configurable gin knows: its defaults alone
        pass
    return values


def declare(dataset_fn: Callable, raw_images: Callable[[Dict[str, Any]], RawImages]) -> None:
    """Declares `dataset_fn`'s raw-image preprocessing.

    Args:
      dataset_fn: the dataset function as gin references it (decorated already).
      raw_images: `fn(arguments) -> RawImages`, called with `bound_arguments(dataset_fn)`.
    """
    setattr(dataset_fn, ATTRIBUTE, lambda: raw_images(bound_arguments(dataset_fn)))


def of(dataset_fn: Optional[Callable]) -> Optional[RawImages]:
    """`dataset_fn`'s raw-image preprocessing on its gin bindings now; None if it declares none."""
    declared = getattr(dataset_fn, ATTRIBUTE, None)
    return declared() if callable(declared) else None
