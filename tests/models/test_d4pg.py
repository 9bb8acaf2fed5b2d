"""D4PG networks: shapes, tanh-bounded actions, layer norm after the first layer, the support."""

import keras
import numpy as np

from expframe.errors import ConfigError
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from tests.support import TestCase


class D4PGNetworksTest(TestCase):

    def test_policy(self):
        policy = d4pg_policy(observation_size=5, action_size=2, layer_sizes=(32, 16, 8))
        kinds = [type(layer).__name__ for layer in policy.layers]
        # Acme's LayerNormMLP: Linear, LayerNorm, tanh, then Linear + ELU; a near-zero head; tanh.
        self.assertEqual(kinds, ["InputLayer", "Dense", "LayerNormalization", "Activation", "Dense", "Dense",
                                 "Dense", "Activation"])
        self.assertEqual([policy.layers[i].units for i in (1, 4, 5, 6)], [32, 16, 8, 2])
        self.assertEqual(policy.layers[4].activation.__name__, "elu")
        observations = np.random.default_rng(0).normal(0, 100.0, (7, 5)).astype(np.float32)
        actions = policy(observations).numpy()
        self.assertEqual(actions.shape, (7, 2))
        self.assertLess(np.abs(actions).max(), 0.05)    # the head starts near zero
        policy.layers[6].kernel.assign(np.full((8, 2), 50.0, np.float32))
        actions = policy(observations).numpy()
        self.assertTrue(np.all(np.abs(actions) <= 1.0))
        self.assertGreater(np.abs(actions).max(), 0.99)  # saturates at the bounds, never past them

    def test_critic(self):
        critic = d4pg_critic(observation_size=5, action_size=2, layer_sizes=(32, 16), num_atoms=11,
                             v_min=-10.0, v_max=10.0)
        np.testing.assert_allclose(critic.support, np.linspace(-10, 10, 11))
        self.assertIsInstance(critic.layers[critic.layers.index(critic.get_layer("critic_linear0")) + 1],
                              keras.layers.LayerNormalization)
        logits = critic([np.zeros((4, 5), np.float32), np.zeros((4, 2), np.float32)])
        self.assertEqual(tuple(logits.shape), (4, 11))
        self.assertEqual(critic.get_layer("critic_linear0").kernel.shape, (7, 32))  # observation + action

    def test_bad_sizes(self):
        with self.assertRaisesRegex(ConfigError, "d4pg_policy.layer_sizes"):
            d4pg_policy(5, 1, layer_sizes=())
        with self.assertRaisesRegex(ConfigError, "num_atoms"):
            d4pg_critic(5, 1, num_atoms=1)
        with self.assertRaisesRegex(ConfigError, "v_min"):
            d4pg_critic(5, 1, v_min=1.0, v_max=-1.0)
