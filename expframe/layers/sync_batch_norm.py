"""Cross-replica (synchronised) batch normalisation.

`SyncBatchNorm` is `keras.layers.BatchNormalization` with one change: in training
the moments are those of the *global* batch (all replicas, or groups of
`group_size` replicas), computed with one collective. Same constructor, same
weights in the same order, same results on one replica.

How the moments are combined, and why. The usual one-collective recipe all-reduces
(sum x, sum x^2, count) and takes var = E[x^2] - E[x]^2. In float32 that cancels
catastrophically when |mean| >> std: for activations with mean 1e3 and std 1 over
4 replicas of 256 it gave a relative error of 0.38 in the variance, where the
method below gave 2e-5 (float64 reference; tests/layers/test_sync_batch_norm.py). A two-pass variant
(all-reduce the mean, then the centred squares) is exact but costs two collective
latencies per layer. Here each replica computes its own (count, mean, M2 = sum of
squared deviations from its own mean) stably, ONE all_gather shares the
N x (2C + 1) table, and every replica merges it with Chan et al.'s parallel formula:

    mean = sum_r n_r m_r / n,   M2 = sum_r M2_r + sum_r n_r (m_r - mean)^2

which has no large-number cancellation. The table is tiny (N rows of 2C+1), so
gathering costs the same one collective latency as an all-reduce. Gradients flow
through the gather (its gradient sums the upstream gradients over replicas and
returns each replica its slice), so d loss / d x is exact. On CPU replicas the
gather is each replica's own collective op (expframe/replicator/collectives.py),
which keeps tracing the backward pass of a 53-BN-layer ResNet-50 linear in depth.

The moving statistics follow the global batch, so they are the same on every
replica: they are created under `identical_updates()`, which tells
`Replicator.scope()` not to average their updates over replicas (it does so for
plain `keras.layers.BatchNormalization`, whose statistics differ per replica).

This layer overrides Keras' private `BatchNormalization._moments` and reads
`_reduction_axes`; importing the module checks that Keras still has and uses them
(expframe/replicator/keras_hooks.py). Under parameter servers there is no global
batch: the layer refuses to be built there, naming the gin binding to change.
"""

from typing import Optional

import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator import collectives, keras_hooks
from expframe.replicator.replicator import identical_updates


def check_keras_hooks() -> None:
    """Fails at import on a Keras whose batch norm no longer computes its moments
    through the hook this layer overrides (see keras_hooks.py)."""
    silent = "SyncBatchNorm would silently normalise with per-replica moments"
    keras_hooks.require_hook(keras.layers.BatchNormalization, "_moments", "SyncBatchNorm", silent,
                             called_by="call")
    keras_hooks.require_hook(keras.layers.BatchNormalization, "_reduction_axes", "SyncBatchNorm",
                             "SyncBatchNorm cannot find the axes to take moments over", set_by="build")


check_keras_hooks()


def _refuse_asynchronous() -> None:
    """ConfigError when created for a parameter-server strategy: before any step is traced."""
    if not isinstance(tf.distribute.get_strategy(), tf.distribute.experimental.ParameterServerStrategy):
        return
    from expframe import gin_errors  # pylint: disable=import-outside-toplevel
    bindings = gin_errors.bindings_to("SyncBatchNorm")
    fix = (" or ".join(f"{b} = @BatchNormalization" for b in bindings) if bindings
           else "keras.layers.BatchNormalization instead")
    raise ConfigError(
        "SyncBatchNorm cannot synchronise under Replicator.target='parameter_server' (workers step "
        f"asynchronously: there is no global batch); use {fix} (per-worker statistics) for that target.")


def _local_moments(x, axes, mask):
    """(count, mean, M2) of x over `axes` on this replica, in float32, shape [C]."""
    if mask is None:
        shape = tf.shape(x)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), x.dtype)
        mean = tf.reduce_mean(x, axis=axes)
        centred = x - tf.reshape(mean, _keep_shape(x, axes))
        m2 = tf.reduce_sum(tf.square(centred), axis=axes)
        count = tf.fill(tf.shape(mean), count)
        return count, mean, m2
    weight = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
    count = tf.reduce_sum(weight, axis=axes)
    mean = tf.math.divide_no_nan(tf.reduce_sum(weight * x, axis=axes), count)
    centred = x - tf.reshape(mean, _keep_shape(x, axes))
    m2 = tf.reduce_sum(weight * tf.square(centred), axis=axes)
    return count, mean, m2


def _keep_shape(x, axes):
    return [1 if i in axes else -1 for i in range(x.shape.rank)]


def merge_moments(counts, means, m2s):
    """Chan's parallel merge over the leading axis. Returns (mean, variance)."""
    total = tf.reduce_sum(counts, axis=0)
    mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, axis=0), total)
    m2 = tf.reduce_sum(m2s, axis=0) + tf.reduce_sum(counts * tf.square(means - mean), axis=0)
    return mean, tf.math.divide_no_nan(m2, total)


@keras.saving.register_keras_serializable(package="expframe")
class SyncBatchNorm(keras.layers.BatchNormalization):
    """Batch normalisation with moments over the global batch of all replicas.

    Example:
      with replicator.scope():
          model = keras.Sequential([keras.layers.Conv2D(8, 3), SyncBatchNorm(), ...])

    Args:
      group_size: if set, normalise with the moments of groups of `group_size`
        consecutive replicas (replica r is in group r // group_size), as for very
        large replica counts. The moving statistics still follow the moments of the
        whole global batch, so they are identical on every replica.
      **kwargs: those of `keras.layers.BatchNormalization` (`synchronized` is
        ignored: this layer is always synchronised through expframe's collectives).
    """

    def __init__(self, *args, group_size: Optional[int] = None, **kwargs):
        _refuse_asynchronous()
        kwargs.pop("synchronized", None)
        super().__init__(*args, **kwargs)
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ConfigError(f"SyncBatchNorm group_size={group_size!r} must be a positive integer or None.")
        if group_size is not None and self.renorm:
            raise ConfigError("SyncBatchNorm: group_size with renorm=True is not supported; drop one of them.")
        self.group_size = group_size

    def _gathered_moments(self, inputs, mask):
        """Returns ((mean, var) to normalise with, (mean, var) of the whole batch)."""
        n = collectives.num_replicas()
        axes = list(self._reduction_axes)
        count, mean, m2 = _local_moments(inputs, axes, mask)
        if n == 1:
            moments = merge_moments(count[None], mean[None], m2[None])
            return moments, moments
        channels = tf.shape(mean)[0]
        table = collectives.all_gather(tf.concat([count, mean, m2], axis=0)[None], axis=0)
        counts, means, m2s = table[:, :channels], table[:, channels:2 * channels], table[:, 2 * channels:]
        whole = merge_moments(counts, means, m2s)
        group = self.group_size
        if group is None or group >= n:
            return whole, whole
        g = collectives.replica_id() // group
        def pick(t):
            return tf.reshape(t, [n // group, group, -1])[g]

        return merge_moments(pick(counts), pick(means), pick(m2s)), whole

    def build(self, input_shape):
        n = collectives.num_replicas()
        if self.group_size is not None and self.group_size < n and n % self.group_size:
            raise ConfigError(
                f"SyncBatchNorm group_size={self.group_size} does not divide the {n} replicas; "
                f"use a divisor of {n}.")
        with identical_updates():
            super().build(input_shape)

    def _moments(self, inputs, mask):
        collectives.require_synchronous("SyncBatchNorm")
        if collectives.num_replicas() == 1 and self.group_size is None:
            # Exactly keras.layers.BatchNormalization on one device.
            return super()._moments(inputs, mask)
        return self._gathered_moments(inputs, mask)[0]

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable) or self.group_size is None:
            return super().call(inputs, training=training, mask=mask)
        collectives.require_synchronous("SyncBatchNorm")
        # group_size: normalise with the group's moments, track the whole batch's.
        x = tf.cast(inputs, "float32") if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        (mean, var), (whole_mean, whole_var) = self._gathered_moments(x, mask)
        self.moving_mean.assign(self.moving_mean * self.momentum + whole_mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            self.moving_variance * self.momentum + whole_var * (1.0 - self.momentum))
        outputs = keras.ops.batch_normalization(
            x, mean=mean, variance=var, axis=self.axis,
            offset=self.beta if self.center else None, scale=self.gamma if self.scale else None,
            epsilon=self.epsilon)
        return tf.cast(outputs, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config["group_size"] = self.group_size
        return config
