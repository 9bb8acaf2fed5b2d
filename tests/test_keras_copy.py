"""expframe/keras_copy.py: a model's plain Keras copy holds only Keras layers, the model's
weights, and gives its outputs at inference (exactly, here); models it cannot copy are
refused with the layer that stops them. Loading the copy where expframe was never
imported: tests/test_export_classifier.py."""

import keras
import numpy as np
import pytest

from expframe import keras_copy
from expframe.layers import SNDense, SyncBatchNorm
from expframe.models.resnet import ZeroPadShortcut

RNG = np.random.default_rng(0)


def _moved(norm):
    """Statistics and affine weights off their defaults, so inference depends on them."""
    channels = norm.moving_mean.shape[0]
    for variable, value in ((norm.moving_mean, RNG.normal(size=channels)),
                            (norm.moving_variance, RNG.uniform(0.5, 2.0, size=channels)),
                            (norm.gamma, RNG.uniform(0.5, 2.0, size=channels)), (norm.beta, RNG.normal(size=channels))):
        variable.assign(value.astype(np.float32))


def _classes(model):
    return {type(layer).__module__.split(".")[0] for layer in model._flatten_layers(include_self=False)}  # noqa: SLF001  pylint: disable=protected-access


def test_sync_batch_norm_and_the_zero_pad_shortcut_become_keras_layers(tmp_path):
    inputs = keras.Input((9, 7, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = SyncBatchNorm(group_size=2, momentum=0.8, epsilon=1e-3, name="norm")(x)
    short = ZeroPadShortcut(8, 2, name="shortcut")(x)
    y = keras.layers.Conv2D(8, 3, strides=2, padding="same")(x)
    model = keras.Model(inputs, keras.layers.Add()([short, y]))
    _moved(model.get_layer("norm"))
    copy = keras_copy.plain_copy(model)
    assert _classes(copy) == {"keras"}
    norm = copy.get_layer("norm")
    assert type(norm) is keras.layers.BatchNormalization and (norm.momentum, norm.epsilon) == (0.8, 1e-3)
    assert type(copy.get_layer("shortcut")) is keras.Sequential
    for want, got in zip(model.get_weights(), copy.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    images = RNG.normal(size=(3, 9, 7, 3)).astype(np.float32)
    want = model(images, training=False).numpy()
    np.testing.assert_array_equal(copy(images, training=False).numpy(), want)
    # The shortcut: every 2nd pixel (5 x 4 of 9 x 7), its 4 channels between 2 zero ones each side.
    shortcut = keras.Model(inputs, short)
    features = keras.Model(inputs, x)(images, training=False).numpy()
    expected = np.pad(features[:, ::2, ::2, :], [(0, 0), (0, 0), (0, 0), (2, 2)])
    np.testing.assert_array_equal(keras_copy.plain_copy(shortcut)(images, training=False).numpy(), expected)
    copy.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(loaded(images, training=False).numpy(), want)


def test_a_sequential_model_keeps_its_dtype_policy():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, dtype="mixed_bfloat16"),
                              SyncBatchNorm(dtype="mixed_bfloat16", name="norm"), keras.layers.Dense(2)])
    _moved(model.get_layer("norm"))
    copy = keras_copy.plain_copy(model)
    assert copy.get_layer("norm").dtype_policy.name == "mixed_bfloat16" and _classes(copy) == {"keras"}
    x = RNG.normal(size=(4, 5)).astype(np.float32)
    np.testing.assert_array_equal(copy(x, training=False).numpy(), model(x, training=False).numpy())


class _Wrapped(keras.layers.Layer):
    """A user's layer that holds an expframe layer: the copy would rebuild it inside."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = SyncBatchNorm()

    def call(self, x, training=None):
        return self.norm(x, training=training)


class _Scale(keras.layers.Layer):
    """A user's layer without get_config: Keras cannot rebuild it."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def call(self, x):
        return x * self.factor


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("build, reason", [
    (lambda: keras.Sequential([keras.Input((3,)), SNDense(2, name="sn")]),
     r"layer 'sn' \(SNDense\) has no plain Keras equivalent"),
    (lambda: keras.Sequential([keras.Input((3,)), _Wrapped(name="wrapped")]),
     r"layer '\w+' \(SyncBatchNorm\) has no plain Keras equivalent"),
    (_Subclassed, r"Keras could not copy the _Subclassed model's layers \(ValueError: Arguments `clone_function` "
                  r"and `input_tensors` are only supported for Sequential models or Functional models"),
    (lambda: keras.Sequential([keras.Input((3,)), _Scale(2.0)]),
     r"Keras could not copy the Sequential model's layers \(TypeError: Error when deserializing class '_Scale'"),
], ids=["spectral_norm", "nested_in_a_user_layer", "subclassed", "no_config"])
def test_models_without_a_plain_copy_are_refused_with_the_reason(build, reason):
    model = build()
    model(np.zeros((1, 3), np.float32))
    with pytest.raises(keras_copy.NoPlainCopy, match=reason):
        keras_copy.plain_copy(model)
