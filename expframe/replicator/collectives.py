"""Collectives for use inside a replicated step (replica context).

Every function reduces over *all replicas in sync* (all local devices, on every
worker), takes a nested structure (dict, list, tuple) of tensors, and is the
identity with one replica, so single-device code needs no branch. Outside any
Replicator (no strategy) they behave as on one replica.

Small tensors of one dtype are packed into one flat buffer and reduced with one
collective: each collective has a fixed latency that dominates for the many small
tensors of a model's gradients or batch-norm statistics.
"""

from typing import Any

import tensorflow as tf

from expframe.errors import ConfigError

_OPS = ("sum", "mean", "max", "min")
# Tensors up to this many elements are packed together into one collective.
_PACK_MAX_ELEMENTS = 1 << 18  # 1 MB of float32


def _context() -> tf.distribute.ReplicaContext:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "expframe collectives must be called inside a replicated step (the step_fn "
            "given to Replicator.run), not in cross-replica code; use Replicator.reduce there.")
    return ctx


def num_replicas() -> int:
    """Number of replicas in sync (a Python int). 1 outside any Replicator."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None:  # cross-replica context: the strategy knows.
        return tf.distribute.get_strategy().num_replicas_in_sync
    return ctx.num_replicas_in_sync


def replica_id() -> tf.Tensor:
    """This replica's index in [0, num_replicas()) as an int32 tensor (global across workers)."""
    rid = _context().replica_id_in_sync_group
    return tf.cast(rid, tf.int32)


def _pack_reduce(ctx, reduce_op, tensors):
    """Sums or means a flat list of tensors: one collective per dtype, small ones packed.

    One call per dtype because TensorFlow keeps int32 tensors in host memory and a
    single batched reduction cannot mix host and device tensors.
    """
    out = [None] * len(tensors)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        small = [i for i in idx if (tensors[i].shape.num_elements() or _PACK_MAX_ELEMENTS + 1)
                 <= _PACK_MAX_ELEMENTS]
        packed = len(small) > 1
        singles = [i for i in idx if not packed or i not in small]
        batch = [tensors[i] for i in singles]
        if packed:
            batch.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in small], axis=0))
        reduced = ctx.all_reduce(reduce_op, batch)
        for i, r in zip(singles, reduced):
            out[i] = r
        if packed:
            sizes = [tensors[i].shape.num_elements() for i in small]
            for i, piece in zip(small, tf.split(reduced[-1], sizes)):
                out[i] = tf.reshape(piece, tensors[i].shape)
    return out


def all_reduce(x: Any, op: str = "sum") -> Any:
    """Reduces `x` elementwise over all replicas; every replica gets the result.

    Args:
      x: a tensor or nested structure of tensors, same shapes on every replica.
      op: "sum", "mean", "max" or "min".

    Returns:
      The same structure, reduced. With one replica, `x` itself.
    """
    if op not in _OPS:
        raise ValueError(f"all_reduce op={op!r}: use one of {', '.join(_OPS)}.")
    if num_replicas() == 1:
        return x
    ctx = _context()
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]
    if op in ("sum", "mean"):
        reduce_op = tf.distribute.ReduceOp.SUM if op == "sum" else tf.distribute.ReduceOp.MEAN
        return tf.nest.pack_sequence_as(x, _pack_reduce(ctx, reduce_op, flat))
    # max/min: tf.distribute has no such reduction; gather one slice per replica
    # (a new leading axis) and reduce it locally. Exact, and deterministic.
    gathered = ctx.all_gather([t[tf.newaxis] for t in flat], axis=0)
    fn = tf.reduce_max if op == "max" else tf.reduce_min
    return tf.nest.pack_sequence_as(x, [fn(g, axis=0) for g in gathered])


def broadcast(x: Any, source: int = 0) -> Any:
    """Every replica gets replica `source`'s value of `x` (tf.distribute has no broadcast).

    Built as a sum in which every replica but `source` contributes zeros: exact for
    any value (a NaN on a non-source replica is masked by `where`, not multiplied).
    """
    n = num_replicas()
    if not isinstance(source, int) or not 0 <= source < n:
        raise ValueError(f"broadcast source={source!r} must be a replica index in [0, {n}).")
    if n == 1:
        return x
    is_source = tf.equal(replica_id(), source)
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]
    masked = []
    for t in flat:
        if t.dtype == tf.bool:
            t = tf.cast(t, tf.int32)
        masked.append(tf.where(is_source, t, tf.zeros_like(t)))
    summed = _pack_reduce(_context(), tf.distribute.ReduceOp.SUM, masked)
    out = [tf.cast(s, tf.bool) if t.dtype == tf.bool else s for s, t in zip(summed, flat)]
    return tf.nest.pack_sequence_as(x, out)


def all_gather(x: Any, axis: int = 0) -> Any:
    """Concatenates `x` from all replicas along `axis`, in replica order.

    Gradients flow back to each replica's own slice (summed over the replicas
    that used the gathered result).
    """
    if num_replicas() == 1:
        return x
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]
    return tf.nest.pack_sequence_as(x, _context().all_gather(flat, axis=axis))


def require_synchronous(what: str) -> None:
    """Raises ConfigError where `what` needs synchronous replicas and cannot have them.

    Under a parameter-server strategy workers step asynchronously: there is no global
    batch to take statistics over. In cross-replica context of a multi-replica
    strategy there is no replica to gather from.
    """
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ConfigError(
            f"{what} cannot synchronise under Replicator.target='parameter_server' "
            "(workers step asynchronously, there is no global batch); use "
            "keras.layers.BatchNormalization (per-worker statistics) for that target.")
    if strategy.num_replicas_in_sync > 1 and tf.distribute.get_replica_context() is None:
        raise ConfigError(f"{what} in training mode must run inside Replicator.run (replica context).")
