"""Per-channel moments of a batch split over replicas, with O(channels) collective bytes.

Every replica holds a slice of the batch. The moments of the whole batch (or of a
group of replicas) need sums over all of it, and a float32 sum of squares loses the
variance when |mean| >> std: E[x^2] - E[x]^2 cancels. Shifting the data first,

    S1 = sum_i (x_i - s),   S2 = sum_i (x_i - s)^2,
    mean = s + S1 / n,      var = S2 / n - (S1 / n)^2,

keeps it exact as long as the shift s is near the mean: the relative error of var is
about float32's epsilon x (1 + (mean - s)^2 / var) x the summation's growth, whatever
the mean is. Every replica must shift by the same s, known before the reduction.

Forward. `moments` shifts by the layer's moving mean, the one statistic every replica
already holds with the same value (SyncBatchNorm keeps it identical on every
replica), and reduces (count, S1, S2) with ONE all-reduce of 2C + 1 floats over the
group. After training's first steps the moving mean lies within a few standard
deviations of the batch mean. At the first step it is 0, and the data need not be
centred (mean 1e3, std 1): then the shift is far, and the reduced sums say so before
they are used: (mean - s)^2 > `FAR` x var on some channel. Every replica of the group
holds the same reduced sums, so all take the same branch of a `tf.cond`: a second
all-reduce of the squares about the now-known mean, C floats, exact for any data.

Backward (written out, `tf.custom_gradient`). Every replica's loss depends on its
group's mean and variance, so d(sum of the group's losses)/d x_i needs the upstream
gradients summed over the group, one all-reduce of 2C floats (d mean, d var), then

    d x_i = w_i (d mean + 2 d var (x_i - mean)) / n        (w_i: the mask, or 1),

the derivative of the group's mean and biased variance. One unconditional collective:
autodiff through the cond would put a second cond, and a collective in it, in the
backward pass (see `reduced_moments` on why a cond with a collective needs care).

Per call and replica: 2C + 1 floats forward and 2C backward in the steady state,
C more forward at the first steps. None of it depends on the replica count. Where the
strategy's reduction cannot sit inside a cond (it needs `merge_call`: MirroredStrategy
over GPUs without groups, MultiWorkerMirroredStrategy;
`collectives.reduces_in_control_flow`), the second pass runs every step: 3C + 1
floats in two collectives forward.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from expframe.replicator import collectives

# (mean - shift)^2 / var above which the shifted sums are not trusted (per channel).
# Measured on 4 x 256 values of std 1 (tests/layers/test_cross_replica_moments.py): the
# variance's relative error is 1e-6 at 3 standard deviations, 1.5e-5 at 5, 7e-5 at 8;
# at the bound of 4 it stays a decade inside the 1e-4 the layer guarantees.
FAR = 16.0
# Name scopes of the collectives (what expframe.plan.collective_table reads).
SUMS, SQUARES, GRADIENTS = "cross_replica_sums", "cross_replica_squares", "cross_replica_gradients"

Sums = Tuple[tf.Tensor, tf.Tensor, tf.Tensor]


def keep_shape(rank: int, axes: Sequence[int]) -> List[int]:
    """A shape that broadcasts a [C] vector against a tensor of `rank` reduced over `axes`."""
    return [1 if i in axes else -1 for i in range(rank)]


def _weights(x: tf.Tensor, mask: Optional[tf.Tensor]) -> Optional[tf.Tensor]:
    """The mask ([B, ...] without the channel axis) as float weights broadcast to x."""
    if mask is None:
        return None
    return tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))


def local_sums(x: tf.Tensor, axes: Sequence[int], mask: Optional[tf.Tensor], shift: tf.Tensor) -> Sums:
    """(count [1], S1 [C], S2 [C]) of x - shift on this replica, over `axes`."""
    centred = x - tf.reshape(shift, keep_shape(x.shape.rank, axes))
    w = _weights(x, mask)
    if w is None:
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)[tf.newaxis]
        return count, tf.reduce_sum(centred, axis=axes), tf.reduce_sum(tf.square(centred), axis=axes)
    # The mask has no channel axis: every channel counts the same elements.
    count = tf.reduce_sum(w, axis=axes)[:1]
    return count, tf.reduce_sum(w * centred, axis=axes), tf.reduce_sum(w * tf.square(centred), axis=axes)


def _centred_squares(x, axes, mask, mean):
    """Sum over `axes` of (x - mean)^2 on this replica."""
    d = tf.square(x - tf.reshape(mean, keep_shape(x.shape.rank, axes)))
    w = _weights(x, mask)
    return tf.reduce_sum(d if w is None else w * d, axis=axes)


def _value(shift, dtype=tf.float32) -> tf.Tensor:
    """The shift's value in `dtype` (a variable is read here)."""
    return tf.stop_gradient(tf.cast(tf.convert_to_tensor(shift), dtype))


def reduced_moments(sums: Sums, shift, group_size: Optional[int],
                    centred_squares: Callable[[tf.Tensor], tf.Tensor]) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(mean, variance, count) over this replica's group from its local shifted sums
    (not differentiated: `moments` writes the gradient).

    Args:
      sums: this replica's `local_sums`.
      shift: what they were taken around ([C], the same on every replica of the group):
        the layer's moving mean, a variable, read again inside the branches (below).
      group_size: as `collectives.all_reduce`'s (None: all replicas).
      centred_squares: mean -> this replica's sum of squares about `mean` ([C]), for
        the far branch.
    """
    count, s1, s2 = sums
    channels = s1.shape[0]
    # One all-reduce over the group: count, S1, S2 packed in one buffer of 2C + 1.
    with tf.name_scope(SUMS):
        total = collectives.all_reduce(tf.concat([count, s1, s2], axis=0), "sum", group_size=group_size)
    n = total[0]
    offset = tf.math.divide_no_nan(total[1:1 + channels], n)
    shifted_var = tf.maximum(tf.math.divide_no_nan(total[1 + channels:], n) - tf.square(offset), 0.0)
    # The same reduced values on every replica of the group: every replica takes the same branch.
    far = tf.reduce_any(tf.square(offset) > FAR * shifted_var)

    # Each branch reads the shift. A cond holding a collective is a stateful op; with no
    # resource input, the step's automatic control dependencies chain it after every
    # such op traced before it, and the replicas are traced one after another into one
    # graph: replica 1's first layer would wait for replica 0's last, whose collective
    # waits for replica 1 (a deadlock, seen with two layers on 2 replicas). Reading this
    # replica's moving mean makes that variable the cond's resource: it is ordered with
    # this replica's reads and writes of it, and nothing else.
    def second_pass():
        mean = _value(shift, offset.dtype) + offset
        # All-reduce over the group of the squares about the group's mean: C floats, exact.
        with tf.name_scope(SQUARES):
            m2 = collectives.all_reduce(centred_squares(mean), "sum", group_size=group_size)
        return mean, tf.math.divide_no_nan(m2, n)

    if not collectives.reduces_in_control_flow(2 * channels + 1, group_size):
        # The strategy reduces through merge_call, which a cond cannot hold: the second
        # pass every time (2 collectives forward; exact, whatever the shift).
        mean, var = second_pass()
        return mean, var, n
    mean, var = tf.cond(far, second_pass, lambda: (_value(shift, offset.dtype) + offset, shifted_var))
    return mean, var, n


def moments(x: tf.Tensor, axes: Sequence[int], mask: Optional[tf.Tensor], shift,
            group_size: Optional[int] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """(mean, variance) per channel of float32 x over `axes` and over the replicas of
    this replica's group (all replicas when group_size is None), differentiable in x.

    `shift` ([C]) must be the same on every replica of the group: the moving mean, a
    variable of this replica (a constant serves a step with one such call: see
    `reduced_moments`)."""
    rank = x.shape.rank

    @tf.custom_gradient
    def forward(x):
        frozen = tf.stop_gradient(x)
        mean, var, n = reduced_moments(local_sums(frozen, axes, mask, _value(shift, x.dtype)), shift, group_size,
                                       lambda m: _centred_squares(frozen, axes, mask, m))

        def grad(d_mean, d_var, variables=None):
            d_mean = tf.zeros_like(mean) if d_mean is None else d_mean
            d_var = tf.zeros_like(var) if d_var is None else d_var
            # The group's upstream gradients, summed over its replicas: one all-reduce of 2C.
            with tf.name_scope(GRADIENTS):
                summed = collectives.all_reduce(tf.concat([d_mean, d_var], axis=0), "sum", group_size=group_size)
            g_mean, g_var = tf.split(summed, 2)
            shape = keep_shape(rank, axes)
            dx = (tf.reshape(g_mean, shape) + 2.0 * tf.reshape(g_var, shape) * (frozen - tf.reshape(mean, shape)))
            w = _weights(frozen, mask)
            dx = tf.math.divide_no_nan(dx if w is None else w * dx, n)
            return dx, [None] * len(variables or ())  # the moving mean (the shift) gets no gradient

        return (mean, var), grad

    return forward(x)
