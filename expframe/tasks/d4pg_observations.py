"""D4PGTask's observation network (pixels): an encoder shared by critic and policy, as Acme's D4PG.

With `D4PGTask.observation_network` bound (e.g. `@drq_encoder`), observations pass through
it before the policy and critic networks, which then see features (Acme's TF D4PG,
acme/agents/tf/d4pg/learning.py, `observation_network`):
  * the critic's loss trains it: the critic optimizer's variables are the observation
    network's and the critic's;
  * the policy reads its features with gradients stopped, so the policy's loss never
    moves it;
  * the critic's target reads next observations through a target copy of it, copied
    with the other targets every `target_update_period` learner steps.
Acting needs both: `make_acting_policy` composes a fresh observation network and policy
(the actor's own variables) and `acting_weights` gives their weights in that order.
Without an observation network nothing changes: features are the observations.
"""

from typing import List

import keras
import numpy as np
import tensorflow as tf


class ObservationNetworks:
    """The observation-network half of `D4PGTask` (mixed in; see module docstring)."""

    observation_network = None
    target_observation_network = None

    def _observation_networks(self, target_creator):
        """(online, target) observation networks, or (None, None) without one; the target's
        variables made under `target_creator` (replica-local, as the other targets)."""
        if self._observation_network_fn is None:
            return None, None
        shape = self.environment.observation_shape
        online = self._observation_network_fn(observation_shape=shape)
        with tf.variable_creator_scope(target_creator):
            return online, self._observation_network_fn(observation_shape=shape)

    def _feature_size(self, observation_network) -> int:
        if observation_network is None:
            return self.environment.observation_size
        return int(observation_network.outputs[0].shape[-1])

    @staticmethod
    def _encode(observations, network, training: bool = False):
        return observations if network is None else network(observations, training=training)

    def _critic_variables(self) -> List[tf.Variable]:
        """What the critic's optimizer trains: the observation network (if any) and the critic."""
        encoder = [] if self.observation_network is None else self.observation_network.trainable_variables
        return encoder + self.critic.trainable_variables

    def make_acting_policy(self, environment) -> keras.Model:
        """A fresh policy for acting on the environment's observations: the policy network,
        after the observation network if there is one. Takes `acting_weights()`."""
        act = environment.action_size
        if self._observation_network_fn is None:
            return self._policy_fn(observation_size=environment.observation_size, action_size=act)
        encoder = self._observation_network_fn(observation_shape=environment.observation_shape)
        head = self._policy_fn(observation_size=self._feature_size(encoder), action_size=act)
        observations = keras.Input(environment.observation_shape, dtype=encoder.inputs[0].dtype)
        return keras.Model(observations, head(encoder(observations)), name="acting_policy")

    def acting_weight_names(self) -> List[str]:
        """Names of `acting_weights()`, as `expframe.rl.actors.weight_names` gives them for
        `make_acting_policy()`'s model: an actor checks them before loading the weights."""
        from expframe.rl.actors import weight_names  # pylint: disable=import-outside-toplevel
        encoder = [] if self.observation_network is None else [self.observation_network]
        return weight_names(*encoder, self.policy)

    def acting_weights(self) -> List[np.ndarray]:
        """The weights of `make_acting_policy()`'s model: the observation network's, then the policy's."""
        encoder = [] if self.observation_network is None else self.observation_network.get_weights()
        return encoder + self.policy.get_weights()
