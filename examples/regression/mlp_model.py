"""The tutorial's model: a small multi-layer perceptron (docs/extending.md)."""

import gin
import keras


@gin.configurable
def mlp(input_dim: int = 8, hidden: int = 64, depth: int = 2) -> keras.Model:
    """A Keras model from `input_dim` features to one output (a regression)."""
    inputs = keras.Input((input_dim,))
    x = inputs
    for _ in range(depth):
        x = keras.layers.Dense(hidden, activation="gelu")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))
