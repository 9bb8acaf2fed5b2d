"""D4PG's networks (Barth-Maron et al. 2018), as in Acme's `make_networks` for control.

  * Policy: LayerNormMLP(256, 256, 256) -> Linear(action_size) near zero -> tanh, so
    actions lie in [-1, 1] (the environment rescales them to the task's bounds).
  * Critic: concat(observation, action) -> LayerNormMLP(512, 512, 256) ->
    Linear(num_atoms): logits of a categorical distribution of the return over the
    support linspace(v_min, v_max, num_atoms), kept on the model as `critic.support`.

LayerNormMLP is Acme's: Linear -> LayerNorm -> tanh for the first layer (the layer
norm keeps the scale of unnormalised state features in check), then Linear -> ELU
for the others; weights VarianceScaling(1/3, fan_out, uniform). The policy's last
layer starts near zero (VarianceScaling(1e-4)), so early actions are near 0.

Example:
    policy = d4pg_policy(observation_size=5, action_size=1)
    critic = d4pg_critic(observation_size=5, action_size=1)
    logits = critic([observations, policy(observations)])      # [batch, num_atoms]
"""

from typing import Sequence

import gin
import keras
import numpy as np

from expframe.errors import ConfigError


def _uniform_init() -> keras.initializers.Initializer:
    return keras.initializers.VarianceScaling(scale=0.333, mode="fan_out", distribution="uniform")


def _check_sizes(binding: str, sizes) -> tuple:
    sizes = tuple(sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"{binding}={sizes!r} must be a non-empty sequence of positive integers.")
    return sizes


def layer_norm_mlp(inputs, layer_sizes: Sequence[int], prefix: str):
    """Acme's LayerNormMLP on a Keras tensor: Linear, LayerNorm, tanh, then Linear + ELU."""
    x = keras.layers.Dense(layer_sizes[0], kernel_initializer=_uniform_init(), name=f"{prefix}_linear0")(inputs)
    x = keras.layers.LayerNormalization(name=f"{prefix}_layer_norm")(x)
    x = keras.layers.Activation("tanh", name=f"{prefix}_tanh")(x)
    for i, size in enumerate(layer_sizes[1:], start=1):
        x = keras.layers.Dense(size, activation="elu", kernel_initializer=_uniform_init(),
                               name=f"{prefix}_linear{i}")(x)
    return x


@gin.configurable
def d4pg_policy(observation_size: int, action_size: int,
                layer_sizes: Sequence[int] = (256, 256, 256)) -> keras.Model:
    """Deterministic policy: observations [batch, observation_size] -> actions in [-1, 1].

    Args:
      observation_size, action_size: from the environment (the task passes them).
      layer_sizes: widths of the LayerNormMLP.
    """
    sizes = _check_sizes("d4pg_policy.layer_sizes", layer_sizes)
    observations = keras.Input((observation_size,), name="observation")
    x = layer_norm_mlp(observations, sizes, "policy")
    x = keras.layers.Dense(action_size, kernel_initializer=keras.initializers.VarianceScaling(1e-4),
                           name="policy_action")(x)
    actions = keras.layers.Activation("tanh", dtype="float32", name="policy_squash")(x)
    return keras.Model(observations, actions, name="d4pg_policy")


@gin.configurable
def d4pg_critic(observation_size: int, action_size: int, layer_sizes: Sequence[int] = (512, 512, 256),
                num_atoms: int = 51, v_min: float = -150.0, v_max: float = 150.0) -> keras.Model:
    """Distributional critic: [observations, actions] -> logits [batch, num_atoms].

    Args:
      observation_size, action_size: from the environment (the task passes them).
      layer_sizes: widths of the LayerNormMLP.
      num_atoms, v_min, v_max: the categorical support linspace(v_min, v_max, num_atoms)
        of the return; it should cover the task's discounted returns (Control Suite:
        rewards in [0, 1] per step, so returns below 1 / (1 - discount)).

    Returns:
      A Keras model with the attribute `support` (float32 numpy array [num_atoms]).
    """
    sizes = _check_sizes("d4pg_critic.layer_sizes", layer_sizes)
    if isinstance(num_atoms, bool) or not isinstance(num_atoms, int) or num_atoms < 2:
        raise ConfigError(f"d4pg_critic.num_atoms={num_atoms!r} must be an integer >= 2.")
    if not v_min < v_max:
        raise ConfigError(f"d4pg_critic.v_min={v_min!r} must be below d4pg_critic.v_max={v_max!r}.")
    observations = keras.Input((observation_size,), name="observation")
    actions = keras.Input((action_size,), name="action")
    x = keras.layers.Concatenate(name="critic_inputs")([observations, actions])
    x = layer_norm_mlp(x, sizes, "critic")
    logits = keras.layers.Dense(num_atoms, dtype="float32", name="critic_logits")(x)
    model = keras.Model([observations, actions], logits, name="d4pg_critic")
    model.support = np.linspace(v_min, v_max, num_atoms, dtype=np.float32)
    return model
