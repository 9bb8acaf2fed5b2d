"""D4PG's losses: the distributional critic's and the deterministic policy gradient's.

Categorical projection (Bellemare et al. 2017, "A Distributional Perspective on RL",
Algorithm 1; Acme's `l2_project`). The target distribution puts probability p_j on
r + d * z_j; these points fall between the atoms z_i of the support (spacing dz),
so each is split between its two neighbours in proportion to closeness. Written
as one formula, atom i receives

    m_i = sum_j p_j * max(0, 1 - |clip(r + d z_j, v_min, v_max) - z_i| / dz),

the triangular "hat" functions of the atoms, which sum to 1 at every point of
[v_min, v_max]: mass is conserved, and targets outside the support land on its end
atoms (the clip), as in the paper.
"""

import tensorflow as tf


def categorical_projection(support: tf.Tensor, probabilities: tf.Tensor, rewards: tf.Tensor,
                           discounts: tf.Tensor) -> tf.Tensor:
    """Projects the distribution of r + d * Z onto `support`.

    Args:
      support: [num_atoms] evenly spaced atoms z_0 < ... < z_{K-1}.
      probabilities: [batch, num_atoms] probabilities p_j of Z on the support.
      rewards: [batch] (n-step) rewards r.
      discounts: [batch] bootstrap discounts d (0 where the episode ended in a terminal state).

    Returns:
      [batch, num_atoms] probabilities on `support`; each row sums to 1.
    """
    support = tf.convert_to_tensor(support, probabilities.dtype)
    v_min, v_max = support[0], support[-1]
    spacing = (v_max - v_min) / tf.cast(tf.shape(support)[0] - 1, support.dtype)
    rewards = tf.cast(rewards, support.dtype)[:, None]
    discounts = tf.cast(discounts, support.dtype)[:, None]
    targets = tf.clip_by_value(rewards + discounts * support[None, :], v_min, v_max)   # [batch, j]
    # weights[b, i, j]: the share of source atom j that lands on atom i.
    weights = tf.nn.relu(1.0 - tf.abs(targets[:, None, :] - support[None, :, None]) / spacing)
    return tf.reduce_sum(weights * probabilities[:, None, :], axis=-1)


def categorical_td(support: tf.Tensor, logits: tf.Tensor, target_probabilities: tf.Tensor):
    """Per-example cross-entropy of the critic's logits to the projected target, and TD error.

    Returns:
      (cross_entropy [batch], td_error [batch]): the loss, and the difference of the
      two distributions' means, E[target] - E[Q] (its magnitude is the priority).
    """
    target_probabilities = tf.stop_gradient(target_probabilities)
    cross_entropy = tf.nn.softmax_cross_entropy_with_logits(labels=target_probabilities, logits=logits)
    support = tf.cast(support, logits.dtype)
    td_error = (tf.reduce_sum(target_probabilities * support, -1)
                - tf.reduce_sum(tf.nn.softmax(logits) * support, -1))
    return cross_entropy, tf.stop_gradient(td_error)


def dpg_loss(q_values: tf.Tensor, actions: tf.Tensor, tape: tf.GradientTape,
             dqda_clipping: float = None) -> tf.Tensor:
    """Deterministic policy gradient loss (Silver et al. 2014), as Acme's `losses.dpg`.

    The gradient of the loss with respect to the policy's weights is -dQ/da * da/dtheta:
    the action is pulled towards a + dQ/da. With `dqda_clipping`, dQ/da is first
    clipped to that norm per example (Acme's D4PG with clipping on: norm 1).

    Args:
      q_values: [batch] expected values Q(o, pi(o)), computed under `tape`.
      actions: [batch, action_size] pi(o), watched by `tape`.
      tape: the tape that recorded q_values from actions.
      dqda_clipping: None, or the largest norm of dQ/da per example.

    Returns:
      [batch] per-example losses.
    """
    dqda = tape.gradient(q_values, actions)
    if dqda_clipping is not None:
        dqda = tf.clip_by_norm(dqda, dqda_clipping, axes=[-1])
    target = tf.stop_gradient(actions + dqda)
    return 0.5 * tf.reduce_sum(tf.square(target - actions), axis=-1)
