"""Cross-replica (synchronised) batch normalisation.

`SyncBatchNorm` is `keras.layers.BatchNormalization` with one change: in training
the moments are those of the *global* batch (all replicas, or groups of
`group_size` replicas). Same constructor, same weights in the same order (a
checkpoint of either restores into the other), same results on one replica.

How the moments are combined (expframe/layers/cross_replica_moments.py). Each replica
sums (count, x - s, (x - s)^2) per channel around a shift s that every replica holds
with the same value, the layer's moving mean, and ONE all-reduce of those 2C + 1
floats gives the group's mean s + S1/n and variance S2/n - (S1/n)^2. Around a near
shift this is exact in float32; TF-Replicator's and Keras' unshifted sums, E[x^2] -
E[x]^2, are not: for activations of mean 1e3 and std 1 on 4 replicas they were off
by 0.11 of the variance. Where the shift is far from the batch mean (the first step:
moving mean 0) the reduced sums say so, the same on every replica, and a second
all-reduce of the squares about the group's mean (C floats) replaces the variance:
1.7e-7 of float64 in that case (tests/layers/test_cross_replica_moments.py). Per
layer and step a replica sends 2C + 1 floats forward and 2C backward (the gradients
of the mean and variance, summed over the replicas that share them; the backward pass
is written out), whatever the replica count: the N x 3C table the earlier design
gathered, and merged with Chan's formula, grew with N. Measured on CPU replicas
(benchmarks/sync_batch_norm.py: ResNet-50's 53 batch norms, forward and backward, step
time over plain batch norm's): 1.58x on 2 replicas and 2.82x on 32, where the gather
took 1.63x and 4.73x; two collectives per layer (the mean, then the squares about it;
or replica 0's mean broadcast as the shift) took 1.78x and 1.85x on 2 replicas; the
unshifted sums 1.35x, with the 0.11 variance error. docs/programming_model.md has the
table.

Groups (`group_size = k`): replica r normalises with the moments of replicas
k(r // k) .. k(r // k) + k - 1, one collective group each (`collectives.all_reduce(
group_size=k)`): a group costs its group, not the world. The moving statistics are
the groups', averaged over all replicas at every update by `Replicator.scope()` (as
for plain `keras.layers.BatchNormalization`: replicator/statistics.py): one copy, the whole
batch's mean and the mean of the groups' variances, which misses the variance
between the groups' means (about var / (group's count) for independent samples:
1e-4 of it for ResNet-50's smallest batch norm in groups of 8 cores of 32 images).
Measured against the whole batch's statistics (one more all-reduce of the shifted
sums over all replicas, beside the group's) on CPU replicas, the average cost less:
step time over plain batch norm 1.79x against 2.66x on 16 replicas in groups of 2,
1.99x against 3.60x on 32 (benchmarks/sync_batch_norm.py, ResNet-50's 53 batch
norms, docs/results.md); on accelerators both are one O(C) all-reduce per layer.
Without groups the moving statistics are the global batch's, the same update on every
replica: they are created under `identical_updates()`, which tells
`Replicator.scope()` not to average them.
Mixed precision: 16-bit inputs are cast to float32 before any moment is taken.

This layer overrides Keras' private `BatchNormalization._moments` and reads
`_reduction_axes`; importing the module checks that Keras still has and uses them
(expframe/replicator/keras_hooks.py). Under parameter servers there is no global
batch: the layer refuses to be built there, naming the gin binding to change.
"""

from typing import Optional

import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.layers import cross_replica_moments
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


@keras.saving.register_keras_serializable(package="expframe")
class SyncBatchNorm(keras.layers.BatchNormalization):
    """Batch normalisation with moments over the global batch of all replicas.

    Example:
      with replicator.scope():
          model = keras.Sequential([keras.layers.Conv2D(8, 3), SyncBatchNorm(), ...])

    Args:
      group_size: if set, normalise with the moments of groups of `group_size`
        consecutive replicas (replica r is in group r // group_size), as the large
        published runs do (MLPerf's TPU ResNet-50: 8 cores; NVIDIA's GPU runs: 1 GPU).
        Each group reduces within itself only. The moving statistics are the
        groups', averaged over the replicas at every update (one copy).
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

    def build(self, input_shape):
        n = collectives.num_replicas()
        try:
            group = collectives.check_group_size(self.group_size, n, "SyncBatchNorm group_size")
        except ValueError as e:
            raise ConfigError(f"{e} (SyncBatchNorm.group_size in gin)") from None
        if group is None:
            # The global batch's statistics: the same update on every replica, no average.
            with identical_updates():
                super().build(input_shape)
        else:
            # Each group's statistics, averaged over the replicas at every step by
            # Replicator.scope() (as for keras BatchNormalization: replicator/statistics.py).
            super().build(input_shape)

    def _group(self) -> Optional[int]:
        """The group size to normalise over (None: all replicas)."""
        return collectives.check_group_size(self.group_size, collectives.num_replicas())

    def _moments(self, inputs, mask):
        collectives.require_synchronous("SyncBatchNorm")
        if collectives.num_replicas() == 1:
            # Exactly keras.layers.BatchNormalization on one device.
            return super()._moments(inputs, mask)
        return cross_replica_moments.moments(inputs, list(self._reduction_axes), mask, self.moving_mean,
                                             self._group())

    def get_config(self):
        config = super().get_config()
        config["group_size"] = self.group_size
        return config
