"""Categorical projection (hand-computed cases, mass conservation), distributional TD, DPG."""

import numpy as np
import tensorflow as tf

from expframe.rl import losses
from tests.support import TestCase

SUPPORT = np.array([-1.0, 0.0, 1.0], np.float32)


def _project(probabilities, rewards, discounts, support=SUPPORT):
    return losses.categorical_projection(tf.constant(support), tf.constant(probabilities, tf.float32),
                                         tf.constant(rewards, tf.float32), tf.constant(discounts, tf.float32)).numpy()


class CategoricalProjectionTest(TestCase):

    def test_hand_computed_case(self):
        # r + d z = 0.5 + 0.5 * [-1, 0, 1] = [0, 0.5, 1]: 0.2 lands on 0, 0.5 splits evenly
        # between 0 and 1, 0.3 lands on 1.
        got = _project([[0.2, 0.5, 0.3]], [0.5], [0.5])
        np.testing.assert_allclose(got, [[0.0, 0.45, 0.55]], atol=1e-6)

    def test_uneven_split_and_terminal(self):
        # d = 0 (terminal): all mass at r = 0.25, split 3:1 between atoms 0 and 1.
        got = _project([[0.1, 0.6, 0.3]], [0.25], [0.0])
        np.testing.assert_allclose(got, [[0.0, 0.75, 0.25]], atol=1e-6)
        # d = 1, r = -0.3: [-1.3, -0.3, 0.7] -> -1.3 clips to -1; -0.3 is 0.3/0.7 to -1/0; 0.7 is 0.3/0.7 to 0/1.
        got = _project([[0.2, 0.5, 0.3]], [-0.3], [1.0])
        np.testing.assert_allclose(got, [[0.2 + 0.5 * 0.3, 0.5 * 0.7 + 0.3 * 0.3, 0.3 * 0.7]], atol=1e-6)

    def test_targets_outside_the_support_land_on_its_ends(self):
        got = _project([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3]], [5.0, -5.0], [1.0, 1.0])
        np.testing.assert_allclose(got, [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], atol=1e-6)

    def test_mass_is_conserved(self):
        rng = np.random.default_rng(0)
        support = np.linspace(-150.0, 150.0, 51).astype(np.float32)
        logits = rng.normal(size=(512, 51))
        probabilities = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        rewards = rng.uniform(-400.0, 400.0, 512)      # many targets fall outside [-150, 150]
        discounts = rng.choice([0.0, 0.5, 0.95, 1.0], 512)
        got = _project(probabilities, rewards, discounts, support)
        self.assertTrue(np.all(got >= 0))
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
        # The mean moves as the Bellman operator says wherever nothing was clipped.
        inside = np.all(np.abs(rewards[:, None] + discounts[:, None] * support) <= 150.0, axis=1)
        self.assertGreater(inside.sum(), 10)
        np.testing.assert_allclose((got * support).sum(-1)[inside],
                                   rewards[inside] + discounts[inside] * (probabilities * support).sum(-1)[inside],
                                   rtol=1e-4, atol=1e-3)


class CategoricalTDTest(TestCase):

    def test_cross_entropy_and_td_error(self):
        logits = tf.constant([[0.0, 1.0, 2.0]])
        target = tf.constant([[0.5, 0.25, 0.25]])
        cross_entropy, td = losses.categorical_td(tf.constant(SUPPORT), logits, target)
        q = tf.nn.softmax(logits).numpy()[0]
        self.assertAllClose(cross_entropy, [-(0.5 * np.log(q[0]) + 0.25 * np.log(q[1]) + 0.25 * np.log(q[2]))])
        self.assertAllClose(td, [(-0.5 + 0.25) - (q[2] - q[0])])


class DPGLossTest(TestCase):

    def test_gradient_is_minus_dqda_clipped_to_norm(self):
        actions = tf.Variable([[0.1, -0.2], [0.3, 0.0]])
        with tf.GradientTape() as outer:
            with tf.GradientTape() as tape:
                tape.watch(actions)
                q = tf.reduce_sum(tf.constant([[3.0, 4.0], [0.3, 0.4]]) * actions, -1)   # dQ/da rows
            loss = tf.reduce_sum(losses.dpg_loss(q, actions, tape, dqda_clipping=1.0))
        # Row 0: dQ/da = (3, 4), norm 5, clipped to (0.6, 0.8); row 1: norm 0.5, unchanged.
        self.assertAllClose(outer.gradient(loss, actions), [[-0.6, -0.8], [-0.3, -0.4]])
        with tf.GradientTape() as outer:
            with tf.GradientTape() as tape:
                tape.watch(actions)
                q = tf.reduce_sum(tf.constant([[3.0, 4.0], [0.3, 0.4]]) * actions, -1)
            loss = tf.reduce_sum(losses.dpg_loss(q, actions, tape, dqda_clipping=None))
        self.assertAllClose(outer.gradient(loss, actions), [[-3.0, -4.0], [-0.3, -0.4]])
