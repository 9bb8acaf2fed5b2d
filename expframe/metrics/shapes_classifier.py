"""The feature network for FID and class accuracy on `shapes`: a small CNN, trained once.

Like the `shapes` dataset itself (generated on first use), the classifier is
trained on first use and cached beside the dataset, in
`<TFDS data dir>/shapes_classifier/<config>-<version>-<hash of the settings>/`
(`classifier.weights.h5` and `info.json` with its test accuracy), so an
experiment such as `experiments/sngan_shapes.gin` runs on a fresh machine with no
earlier step. Training is seeded (its own seeds: it draws nothing from the global
random state, so training it or loading it leaves a run's initialisation as it
was), single-device, and written atomically (temporary file + rename), so a
crash or two runs at once never leave a torn file. On a multi-worker cluster only
one process should train it: train it first with

    python -m expframe.metrics [--data_dir=DIR] [--image_size=32]

Model: images in [-1, 1] -> per-image standardisation (removes the random
background colour and brightness, as the quickstart's input does) -> 3x3 convs
32/2 (stride 2), 64, pool, 128, pool, 128 -> global average pool -> dense 128
(the FID features, after ReLU) -> dense 10 (logits). About 0.97 test accuracy
after the default 1,000 steps of batch 128 (measured; `info.json` records it).
"""

import argparse
import hashlib
import json
import os
import tempfile
from typing import Optional

import gin
import keras
import tensorflow as tf

from expframe.atomic_files import write_json
from expframe.errors import ConfigError
from expframe.metrics.feature_networks import FeatureNetwork

VERSION = 1  # bump when the model or its training changes
_FEATURES = 128


def _standardize(images):
    # tf.image.per_image_standardization: (x - mean) / max(std, 1 / sqrt(num_pixels)).
    x = tf.cast(images, tf.float32)
    mean, var = tf.nn.moments(x, axes=[1, 2, 3], keepdims=True)
    floor = 1.0 / tf.sqrt(tf.cast(tf.reduce_prod(tf.shape(x)[1:]), tf.float32))
    return (x - mean) / tf.maximum(tf.sqrt(var), floor)


def build_classifier(image_size: int, num_classes: int, seed: int = 0) -> keras.Model:
    """The classifier: images [B, S, S, 3] in [-1, 1] -> [features [B, 128], logits [B, K]]."""
    init = lambda i: keras.initializers.HeNormal(seed=seed * 100 + i)  # noqa: E731
    images = keras.Input((image_size, image_size, 3), name="images")
    h = keras.layers.Lambda(_standardize, name="standardize")(images)
    for i, (width, stride, pool) in enumerate(((32, 2, False), (64, 1, True), (128, 1, True), (128, 1, False))):
        h = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False,
                                kernel_initializer=init(i), name=f"conv{i + 1}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{i + 1}")(h)
        h = keras.layers.ReLU()(h)
        if pool:
            h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    features = keras.layers.Dense(_FEATURES, activation="relu", kernel_initializer=init(8), name="features")(h)
    logits = keras.layers.Dense(num_classes, kernel_initializer=init(9), name="logits")(features)
    return keras.Model(images, [features, logits], name="shapes_classifier")


def _dataset(split, image_size, data_dir, num_train, num_test, training, batch, seed):
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    ds = shapes.load_shapes(split, size=image_size, data_dir=data_dir, num_train=num_train, num_test=num_test)
    ds = ds.map(lambda ex: (tf.cast(ex["image"], tf.float32) / 127.5 - 1.0, tf.cast(ex["label"], tf.int32)))
    if training:
        ds = ds.cache().shuffle(20_000, seed=seed).repeat()
    return ds.batch(batch, drop_remainder=training).prefetch(tf.data.AUTOTUNE)


def _cache_dir(image_size, data_dir, num_train, num_test, settings):
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    builder = shapes.Shapes(config=shapes.shapes_config(image_size, num_train, num_test), data_dir=data_dir)
    root = os.path.dirname(os.path.dirname(os.path.dirname(builder.data_dir)))  # <root>/shapes/<config>/<version>
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(root, "shapes_classifier", f"{builder.builder_config.name}-{builder.info.version}-{key}")


def train_classifier(image_size: int, data_dir: Optional[str], num_train: Optional[int], num_test: Optional[int],
                     train_steps: int, batch_size: int, learning_rate: float, seed: int, log=print) -> tuple:
    """Trains the classifier on the train split; returns (model, test accuracy)."""
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    model = build_classifier(image_size, shapes.NUM_CLASSES, seed)
    schedule = keras.optimizers.schedules.CosineDecay(learning_rate, train_steps)
    optimizer = keras.optimizers.Adam(schedule)
    variables = model.trainable_variables

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            _, logits = model(images, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    log(f"expframe: training the shapes classifier for FID ({train_steps} steps of {batch_size}, once per data dir)")
    train = iter(_dataset("train", image_size, data_dir, num_train, num_test, True, batch_size, seed))
    for _ in range(train_steps):
        step(*next(train))
    predict = tf.function(lambda x: tf.argmax(model(x, training=False)[1], -1, output_type=tf.int32))
    correct = total = 0
    for images, labels in _dataset("test", image_size, data_dir, num_train, num_test, False, 500, seed):
        correct += int(tf.reduce_sum(tf.cast(tf.equal(predict(images), labels), tf.int32)))
        total += int(labels.shape[0])
    return model, correct / max(total, 1)


class ShapesClassifier(FeatureNetwork):
    """The cached classifier as a FeatureNetwork; `prepare()` trains or loads it (host side)."""

    labels_match_data = True

    def __init__(self, image_size, data_dir, num_train, num_test, train_steps, batch_size, learning_rate, seed):
        from expframe.data import shapes  # pylint: disable=import-outside-toplevel
        self.image_size, self.data_dir, self.num_train, self.num_test = image_size, data_dir, num_train, num_test
        self.settings = dict(version=VERSION, image_size=image_size, num_train=num_train, num_test=num_test,
                             train_steps=train_steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed)
        self.num_classes = shapes.NUM_CLASSES
        self.directory = _cache_dir(image_size, data_dir, num_train, num_test, self.settings)
        self.weights_path = os.path.join(self.directory, "classifier.weights.h5")
        self.name = "shapes_classifier"
        self.test_accuracy = None
        self._weights = None
        self.model = None

    @property
    def cached(self) -> bool:
        return os.path.isfile(self.weights_path)

    def prepare(self, log=print) -> None:
        """Loads the cached weights, training and caching them first if absent. Host side,
        outside any Replicator scope."""
        if self._weights is not None:
            return
        if not self.cached:
            s = self.settings
            model, accuracy = train_classifier(self.image_size, self.data_dir, self.num_train, self.num_test,
                                               s["train_steps"], s["batch_size"], s["learning_rate"], s["seed"], log)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp_", suffix=".weights.h5")
            os.close(fd)
            model.save_weights(tmp, overwrite=True)
            write_json(os.path.join(self.directory, "info.json"), dict(self.settings, test_accuracy=accuracy))
            os.replace(tmp, self.weights_path)
            log(f"expframe: shapes classifier test accuracy {accuracy:.4f}, cached in {self.directory}")
        model = build_classifier(self.image_size, self.num_classes, self.settings["seed"])
        model.load_weights(self.weights_path)
        self._weights = model.get_weights()
        info = os.path.join(self.directory, "info.json")
        if os.path.isfile(info):
            with open(info, encoding="utf-8") as f:
                self.test_accuracy = json.load(f).get("test_accuracy")

    def build(self) -> None:
        """Inside the Replicator's scope: the replicated model with the cached weights."""
        if self._weights is None:
            raise RuntimeError("ShapesClassifier.prepare() must run before build().")
        self.model = build_classifier(self.image_size, self.num_classes, self.settings["seed"])
        self.model.set_weights(self._weights)

    def __call__(self, images):
        features, logits = self.model(tf.cast(images, tf.float32), training=False)
        return tf.cast(features, tf.float32), tf.cast(logits, tf.float32)


@gin.configurable
def shapes_classifier(image_size: int = 32, data_dir: Optional[str] = None, num_train: Optional[int] = None,
                      num_test: Optional[int] = None, train_steps: int = 1000, batch_size: int = 128,
                      learning_rate: float = 2e-3, seed: int = 0) -> ShapesClassifier:
    """The shapes feature network (see module docstring).

    Args:
      image_size: 32 or 64, as `shapes_input.image_size`.
      data_dir: TFDS data dir (None: $TFDS_DATA_DIR or ~/tensorflow_datasets), as
        `shapes_input.data_dir`.
      num_train, num_test: examples of the shapes build to use (None: the full one),
        as `shapes_input.num_train` / `num_test`.
      train_steps, batch_size, learning_rate (Adam, cosine decay), seed: training.
    """
    if image_size not in (32, 64):
        raise ConfigError(f"shapes_classifier.image_size={image_size!r}: use 32 or 64.")
    for name, value in (("train_steps", train_steps), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"shapes_classifier.{name}={value!r} must be a positive integer.")
    return ShapesClassifier(image_size, data_dir, num_train, num_test, train_steps, batch_size, learning_rate, seed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expframe.metrics",
                                     description="Train and cache the shapes classifier used for FID.")
    parser.add_argument("--data_dir", default=None,
                        help="TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--num_train", type=int, default=None)
    args = parser.parse_args(argv)
    net = shapes_classifier(image_size=args.image_size, data_dir=args.data_dir, num_train=args.num_train)
    if net.cached:
        print(f"already cached: {net.weights_path}")
    net.prepare()
    print(f"{net.weights_path} (test accuracy {net.test_accuracy})")
    return 0

