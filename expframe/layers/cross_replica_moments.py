"""Per-channel moments of a batch split over replicas, with O(channels) collective bytes.

Every replica holds a slice of the batch. The moments of the whole batch (or of a
group of replicas) need sums over all of it, and a float32 sum of squares loses the
variance when |mean| >> std: E[x^2] - E[x]^2 cancels. Shifting the data first,

    S1 = sum_i (x_i - s),   S2 = sum_i (x_i - s)^2,
    mean = s + S1 / n,      var = S2 / n - (S1 / n)^2,

keeps it exact as long as the shift s is near the mean: the relative error of var is
about float32's epsilon x (1 + (mean - s)^2 / var), whatever the mean is. Every
replica must shift by the same s, and it must be known before the reduction.

`moments` shifts by the layer's moving mean, the one statistic every replica already
holds with the same value (SyncBatchNorm keeps it identical on every replica), and
reduces (count, S1, S2) with ONE all-reduce of 2C + 1 floats. After training's first
steps the moving mean lies within a few standard deviations of the batch mean. At the
first step it is 0, and the data need not be centred (mean 1e3, std 1): then the
shift is far, and the reduced sums say so before they are used: (mean - s)^2 >
`FAR` x var on some channel. Every replica of the group sees the same reduced sums,
so all take the same branch of a `tf.cond`: a second all-reduce of the centred
squares about the now-known mean, C floats, exact for any data. Steady state: one
collective of 2C + 1 floats; the far case: two. Neither depends on the replica count.

Gradients flow through the all-reduces (the gradient of a sum over replicas is the sum
of the upstream gradients over the same replicas): in the backward pass, one more
all-reduce of 2C + 1 floats (C in the far branch... plus its first pass: 3C + 1).
"""

from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from expframe.replicator import collectives

# (mean - shift)^2 / var above which the shifted sums are not trusted (per channel).
# At the bound the float32 error of var is about 2^-24 x (1 + FAR) x the reduction's
# growth: 1e-6 measured on 4 x 256 values (tests/layers/test_cross_replica_moments.py),
# well inside the 1e-4 the layer guarantees.
FAR = 16.0

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
    """Sum over `axes` of (x - mean)^2 on this replica (mean held constant: the
    derivative of the group's sum through the mean is zero, as in tf.nn.moments)."""
    d = tf.square(x - tf.reshape(tf.stop_gradient(mean), keep_shape(x.shape.rank, axes)))
    w = _weights(x, mask)
    return tf.reduce_sum(d if w is None else w * d, axis=axes)


def reduced_moments(sums: Sums, shift: tf.Tensor, group_size: Optional[int],
                    centred_squares: Callable[[tf.Tensor], tf.Tensor]) -> Tuple[tf.Tensor, tf.Tensor]:
    """(mean, variance) over this replica's group from its local shifted sums.

    Args:
      sums: this replica's `local_sums`.
      shift: the shift they were taken around ([C], the same on every replica of the group).
      group_size: as `collectives.all_reduce`'s (None: all replicas).
      centred_squares: mean -> this replica's sum of squares about `mean` ([C]), for
        the far branch.
    """
    count, s1, s2 = sums
    channels = s1.shape[0]
    # One all-reduce over the group: count, S1, S2 packed in one buffer of 2C + 1.
    total = collectives.all_reduce(tf.concat([count, s1, s2], axis=0), "sum", group_size=group_size)
    n = total[0]
    offset = tf.math.divide_no_nan(total[1:1 + channels], n)
    mean = shift + offset
    shifted_var = tf.maximum(tf.math.divide_no_nan(total[1 + channels:], n) - tf.square(offset), 0.0)
    # The same reduced values on every replica of the group: every replica takes the same branch.
    far = tf.reduce_any(tf.square(offset) > FAR * shifted_var)

    def second_pass():
        # All-reduce over the group of the squares about the group's mean: C floats, exact.
        m2 = collectives.all_reduce(centred_squares(mean), "sum", group_size=group_size)
        return mean, tf.math.divide_no_nan(m2, n)

    return tf.cond(far, second_pass, lambda: (mean, shifted_var))


def moments(x: tf.Tensor, axes: Sequence[int], mask: Optional[tf.Tensor], shift: tf.Tensor,
            group_size: Optional[int] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """(mean, variance) per channel of x over `axes` and over the replicas of this
    replica's group (all replicas when group_size is None); float32 x.

    `shift` ([C]) must be the same on every replica of the group (the moving mean)."""
    shift = tf.stop_gradient(tf.cast(shift, x.dtype))
    return reduced_moments(local_sums(x, axes, mask, shift), shift, group_size,
                           lambda mean: _centred_squares(x, axes, mask, mean))


def group_and_whole_moments(x: tf.Tensor, axes: Sequence[int], mask: Optional[tf.Tensor], shift: tf.Tensor,
                            group_size: int) -> Tuple[Tuple[tf.Tensor, tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]:
    """((mean, var) of the group, to normalise with; (mean, var) of the whole batch,
    for the moving statistics, not differentiated).

    Both start from the same local sums: the whole batch's all-reduce does not wait
    for the group's, so the two collectives run side by side."""
    shift = tf.stop_gradient(tf.cast(shift, x.dtype))
    sums = local_sums(x, axes, mask, shift)
    group = reduced_moments(sums, shift, group_size, lambda mean: _centred_squares(x, axes, mask, mean))
    frozen = tf.stop_gradient(x)
    whole = reduced_moments(tuple(tf.stop_gradient(s) for s in sums), shift, None,
                            lambda mean: _centred_squares(frozen, axes, mask, mean))
    return group, tuple(tf.stop_gradient(w) for w in whole)
