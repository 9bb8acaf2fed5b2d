"""An image classifier's serving signatures (`Task.serving`), after Model Garden's
image-classification export: the preprocessed float images the model takes, and raw
images with the dataset's eval preprocessing inside (expframe/data/raw_images.py).

| signature | input | dtype, shape |
|---|---|---|
| `serving_default` | `image`: images preprocessed as the eval pipeline feeds the model | float32 [N, H, W, C] |
| `image_tensor` | `image_tensor`: pixels, one size per call, any size | uint8 [N, height, width, 3] |
| `image_bytes` | `image_bytes`: encoded images (JPEG, PNG, GIF, BMP), each its own size | string [N] |
| `tf_example` | `tf_example`: serialized tf.train.Example, the encoded image in `image/encoded` | string [N] |

Each returns `class_outputs`: `logits`, `probabilities`, `top_k_classes`,
`top_k_probabilities`, and `top_k_class_names` where the class names are known.
"""

from typing import Callable, Dict, Optional, Sequence

import tensorflow as tf

from expframe.data.raw_images import RawImages

Signature = tf.types.experimental.PolymorphicFunction
#: The feature of a `tf_example` input that holds the encoded image (Model Garden's key).
ENCODED_FEATURE = "image/encoded"


def class_outputs(logits: tf.Tensor, class_names: Optional[Sequence[str]] = None) -> Dict[str, tf.Tensor]:
    """A classifier's serving outputs: float32 `logits`, `probabilities` (softmax),
    `top_k_classes` (int32) and `top_k_probabilities`, k = min(5, classes), best first;
    with `class_names` (one per class), `top_k_class_names` (string) too."""
    logits = tf.cast(logits, tf.float32)
    probabilities = tf.nn.softmax(logits)
    top = tf.math.top_k(probabilities, k=min(5, int(logits.shape[-1])))
    out = {"logits": logits, "probabilities": probabilities, "top_k_classes": top.indices,
           "top_k_probabilities": top.values}
    if class_names is not None:
        out["top_k_class_names"] = tf.gather(tf.constant(list(class_names)), top.indices)
    return out


def image_signature(classify: Callable[[tf.Tensor], tf.Tensor], image_shape: Sequence[Optional[int]],
                    class_names: Optional[Sequence[str]] = None) -> Signature:
    """A serving function: `image` float32 [None, *image_shape] -> `class_outputs(classify(image))`."""
    @tf.function(input_signature=[tf.TensorSpec([None, *image_shape], tf.float32, name="image")])
    def serve(image):
        return class_outputs(classify(image), class_names)
    return serve


def _each(fn: Callable[[tf.Tensor], tf.Tensor], items: tf.Tensor, image_shape: Sequence[Optional[int]]) -> tf.Tensor:
    """fn on each item of a batch (its own size each), stacked: float32 [N, *image_shape]."""
    return tf.map_fn(fn, items, fn_output_signature=tf.TensorSpec(image_shape, tf.float32))


def raw_image_signatures(classify: Callable[[tf.Tensor], tf.Tensor], image_shape: Sequence[Optional[int]],
                         raw: RawImages, class_names: Optional[Sequence[str]] = None) -> Dict[str, Signature]:
    """`image_tensor`, `image_bytes` and `tf_example` (module docstring): each image through
    `raw`'s eval preprocessing, then `class_outputs(classify(images))`."""
    def outputs(images):
        return class_outputs(classify(images), class_names)

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="image_tensor")])
    def image_tensor(images):
        return outputs(_each(raw.preprocess, images, image_shape))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")])
    def image_bytes(encoded):
        return outputs(_each(raw.decode, encoded, image_shape))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="tf_example")])
    def tf_example(serialized):
        features = tf.io.parse_example(serialized, {ENCODED_FEATURE: tf.io.FixedLenFeature([], tf.string)})
        return outputs(_each(raw.decode, features[ENCODED_FEATURE], image_shape))

    return {"image_tensor": image_tensor, "image_bytes": image_bytes, "tf_example": tf_example}


def classifier_signatures(classify: Callable[[tf.Tensor], tf.Tensor], image_shape: Sequence[Optional[int]],
                          num_classes: int, raw: Optional[RawImages]) -> Dict[str, Signature]:
    """`serving_default`, and the raw-image signatures where the dataset declares its
    preprocessing (`raw`); class names in the outputs where it names `num_classes` classes.

    Args:
      classify: images as the model takes them -> logits [N, num_classes].
      image_shape: the model's image shape [H, W, C].
      num_classes: the logits' classes.
      raw: the dataset's eval preprocessing (`raw_images.of(dataset_fn)`), or None.
    """
    names = class_names(raw, num_classes)
    signatures = {"serving_default": image_signature(classify, image_shape, names)}
    if raw is not None:
        signatures.update(raw_image_signatures(classify, image_shape, raw, names))
    return signatures


def class_names(raw: Optional[RawImages], num_classes: int) -> Optional[Sequence[str]]:
    """The dataset's class names where there is one per class of the model, else None (a
    model with another head, e.g. fine-tuned to more classes, gets none)."""
    names = None if raw is None else raw.class_names
    return names if names is not None and len(names) == num_classes else None


def labels_asset(names: Optional[Sequence[str]]) -> Dict[str, str]:
    """{"labels.txt": one class name per line, line i for class i}, or {} without names."""
    return {} if names is None else {"labels.txt": "".join(f"{name}\n" for name in names)}
