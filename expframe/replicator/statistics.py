"""One copy of a model's statistics across replicas, for one all-reduce per step.

Keras leaves the moving mean and variance of `keras.layers.BatchNormalization` (and
any non-trainable floating-point variable created without an aggregation)
unaggregated: under MirroredStrategy each replica would update its own copy from its
own shard, the copies would drift apart, and eval and checkpoints would see only the
first. `Replicator.scope()` keeps them as one copy.

How. Until issue 61 they were given MEAN aggregation, so that every `assign` in a
step averaged the assigned value over the replicas: one merge_call and one
cross-device reduction per variable and update, 106 of them per step for ResNet-50's
53 batch norms. Measured on 2 CPU replicas (benchmarks/fit_gap.py, ResNet-50 at
128 px, 30 interleaved repeats), that alone made expframe's step 1.6 % slower
(1.016, interval 1.009-1.028) than the same step with per-replica copies.

Now each replica updates its own copy during the step (no communication), and
`Statistics.step` ends the replicated step with one packed all-reduce of what the
step changed: every replica reads its copies before and after the step, and all
set `before + mean over replicas of (after - before)`. That is the average the
MEAN aggregation took (`mean(after)`, as every replica starts from the same
`before`), in one collective for all the variables, and exactly `before` where the
step changed nothing (an eval step), whatever the replica count. The statistics are
one copy again after every step, before anything can read them.

Covered: the variables created in `Replicator.scope()` before the step is traced
(a model is built before its step, in expframe's tasks). Left as they are: variables
created with an explicit aggregation or synchronization (`identical_updates`:
SyncBatchNorm's statistics, already the same on every replica) and optimizer slots
(created colocated with their variable and updated in cross-replica context).
"""

import weakref
from typing import Any, Callable, List

import tensorflow as tf

from expframe.replicator import collectives


def _is_statistic(kwargs: dict) -> bool:
    """A variable Keras leaves unaggregated that is not trained: a statistic."""
    aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
    synchronization = kwargs.get("synchronization") or tf.VariableSynchronization.AUTO
    dtype = kwargs.get("dtype")
    # A variable colocated with another is a slot (Keras optimizers create their slots under
    # `colocate_vars_with`): the optimizer updates it in cross-replica context, the same
    # on every replica.
    return (kwargs.get("trainable") is False and aggregation == tf.VariableAggregation.NONE
            and synchronization == tf.VariableSynchronization.AUTO and kwargs.get("colocate_with") is None
            and dtype is not None and tf.as_dtype(dtype).is_floating)


class Statistics:
    """The statistics variables of one Replicator, kept as one copy by `step`."""

    def __init__(self):
        self._refs: List[weakref.ref] = []

    def creator(self, next_creator, **kwargs):
        """Variable creator (`tf.variable_creator_scope`) of Replicator.scope(): records
        the statistics it creates (weakly: a dropped model's are forgotten)."""
        variable = next_creator(**kwargs)
        if _is_statistic(kwargs):
            self._refs.append(weakref.ref(variable))
        return variable

    def live(self) -> list:
        """The recorded variables still alive, in creation order."""
        alive = [r() for r in self._refs]
        self._refs = [r for r, v in zip(self._refs, alive, strict=True) if v is not None]
        return [v for v in alive if v is not None]

    def step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`step_fn` (a replica function) followed by one packed all-reduce that makes
        the statistics one copy again; `step_fn` itself when there are none (one replica
        records none: `Replicator.scope()` installs `creator` only for several)."""
        variables = self.live()  # once, outside the replicas: every replica packs the same list
        if not variables:
            return step_fn

        def replica_step(*args, **kwargs):
            before = [v.read_value() for v in variables]  # a read is a copy: the step's writes leave it
            out = step_fn(*args, **kwargs)
            # Automatic control dependencies order these reads after the step's writes.
            change = [v.read_value() - b for v, b in zip(variables, before, strict=True)]
            mean_change = collectives.all_reduce(change, "mean")
            for v, b, c in zip(variables, before, mean_change, strict=True):
                v.assign(b + c)
            return out
        return replica_step
