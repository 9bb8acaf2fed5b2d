"""What a traced step sends through collectives, per replica: read from its graph.

A step traced under `Replicator.run` (on N logical CPU replicas: one copy of the
step per replica in one graph) holds every collective it will make:

* collective ops (`CollectiveReduce` and kin, `CrossReplicaSum`, `NcclAllReduce`):
  expframe's own reductions (`collectives.py`), in the step's graph and in the
  functions it calls (both branches of a `tf.cond`, gradient functions), each with its
  input's element count and, where it has one, its group size;
* the strategy's reductions (`ReplicaContext.all_reduce` / `all_gather`, mean-aggregated
  variable updates, `Strategy.reduce`), which on CPU replicas are copies through one
  device rather than collective ops: `recording_strategy_reductions` records each while
  the step is traced (one value per replica).

`per_replica_elements` adds both up for one replica: the ops of all replicas divided by
the replica count (every replica traces the same step), plus each strategy reduction's
value. Both branches of a `tf.cond` count, so this is the most a step can send.
"""

import contextlib
from typing import Dict, Iterator, List

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops

# Ops that exchange data between replicas.
COLLECTIVE_OPS = frozenset({
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGather", "CollectiveGatherV2",
    "CollectiveAllToAllV2", "CollectiveAllToAllV3", "CollectiveBcastSend", "CollectiveBcastSendV2",
    "NcclAllReduce", "NcclReduce", "NcclBroadcast", "CrossReplicaSum", "AllToAll", "CollectivePermute"})
_FUNCTION_ATTRS = ("then_branch", "else_branch", "branches", "f", "body", "cond")


def _functions(graph) -> Dict:
    """Name -> function of every function defined in `graph` or a graph enclosing it."""
    out = {}
    while graph is not None:
        for name, fn in getattr(graph, "_functions", {}).items():
            out.setdefault(name, fn)
        graph = getattr(graph, "outer_graph", None)
    return out


def _called(op) -> List[str]:
    names = []
    for attr in _FUNCTION_ATTRS:
        try:
            value = op.get_attr(attr)
        except ValueError:
            continue
        for fn in value if isinstance(value, list) else [value]:
            if hasattr(fn, "name"):
                names.append(fn.name)
    return names


def traced_collectives(graph: tf.Graph, _depth: int = 0) -> List[Dict]:
    """Every collective op of `graph` and of the functions it calls, as {'op', 'name',
    'elements', 'bytes', 'group_size'} (a function called twice counts twice)."""
    if _depth > 32:
        raise RecursionError("functions nested more than 32 deep in a traced step")
    found, library = [], _functions(graph)
    for op in graph.get_operations():
        if op.type in COLLECTIVE_OPS and op.inputs:
            t = op.inputs[0]
            elements = t.shape.num_elements()
            if elements is None:
                raise ValueError(f"collective {op.name} has an input of unknown size {t.shape}")
            try:
                group = int(op.get_attr("group_size"))
            except ValueError:
                group = None
            found.append({"op": op.type, "name": op.name, "elements": elements,
                          "bytes": elements * t.dtype.size, "group_size": group})
        for name in _called(op):
            fn = library.get(name)
            if fn is not None and getattr(fn, "graph", None) is not None:
                found += traced_collectives(fn.graph, _depth + 1)
    return found


def _per_replica_value(value) -> Dict:
    values = getattr(value, "values", None) or (value,)
    t = values[0]
    elements = t.shape.num_elements() or 0
    return {"elements": elements, "bytes": elements * t.dtype.size, "replicas": len(values)}


@contextlib.contextmanager
def recording_strategy_reductions() -> Iterator[List[Dict]]:
    """While tracing: every reduction the strategy makes ({'op', 'elements', 'bytes'} of
    one replica's value), through `CrossDeviceOps.reduce` and `batch_reduce`, which the
    strategy's all-reduce, reduce and aggregated variable updates all go through."""
    record: List[Dict] = []
    reduce, batch_reduce = cross_device_ops.CrossDeviceOps.reduce, cross_device_ops.CrossDeviceOps.batch_reduce

    def recorded_reduce(self, reduce_op, per_replica_value, destinations, options=None):
        record.append({"op": "strategy.reduce", **_per_replica_value(per_replica_value)})
        return reduce(self, reduce_op, per_replica_value, destinations, options)

    def recorded_batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        for value, _ in value_destination_pairs:
            record.append({"op": "strategy.batch_reduce", **_per_replica_value(value)})
        return batch_reduce(self, reduce_op, value_destination_pairs, options)

    cross_device_ops.CrossDeviceOps.reduce = recorded_reduce
    cross_device_ops.CrossDeviceOps.batch_reduce = recorded_batch_reduce
    try:
        yield record
    finally:
        cross_device_ops.CrossDeviceOps.reduce, cross_device_ops.CrossDeviceOps.batch_reduce = reduce, batch_reduce


def per_replica_elements(ops: List[Dict], strategy_reductions: List[Dict], num_replicas: int) -> Dict:
    """{'elements', 'bytes', 'ops'}: what one replica sends per step (see the module docstring)."""
    if len(ops) % num_replicas:
        raise ValueError(f"{len(ops)} collective ops do not split evenly over {num_replicas} replicas")
    return {"elements": sum(o["elements"] for o in ops) / num_replicas
            + sum(r["elements"] for r in strategy_reductions),
            "bytes": sum(o["bytes"] for o in ops) / num_replicas + sum(r["bytes"] for r in strategy_reductions),
            "ops": len(ops) // num_replicas + len(strategy_reductions)}
