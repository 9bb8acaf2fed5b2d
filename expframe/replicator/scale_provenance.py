"""Which gradients come from a scaled loss: the check behind `ReplicatedOptimizer`'s
loss scaling (a gradient of an unscaled loss would be divided by the scale).

Traced (inside a `tf.function`), every tensor that a gradient is computed from is
given a kind, walking the graph back from the gradient:
  SCALED   computed from a scale that `scale_loss` or `minimize` made (recorded here);
  ZERO     a constant zero (an unconnected gradient, a fresh accumulator);
  OTHER    anything else: a gradient of an unscaled loss, a forward value;
  MIXED    a sum of a SCALED term and an OTHER one: a partly scaled loss, e.g.
           `scale_loss(ce) + l2`, whose regulariser would be divided by the scale.
A gradient is a linear function of the upstream gradient of the loss, so inside a
correct backward pass a sum never adds a term that does not carry it: every term of a
sum of gradients is SCALED, or ZERO. The rules: a scale is SCALED; a sum (Add, AddV2,
AddN, Sub) of SCALED and OTHER terms is MIXED; any other op is SCALED if an input is
(Mul(upstream, scale) is where scaling happens), MIXED if an input is. The walk goes
into the graphs that a graph calls: a nested `tf.function` (its output's kind from its
body, its inputs bound to the caller's), a `tf.cond` (both branches: SCALED in one and
OTHER in the other is MIXED), and a `tf.while_loop` / `tf.range` loop (each loop
variable's kind joins its initial value and the body's output, to a fixed point, so an
accumulator that starts at zero and adds SCALED gradients is SCALED).

Eagerly there is no graph: `scaled_loss` multiplies under a custom gradient that counts
each backward pass through it, and a gradient update needs one: `scale_loss` called for
a log line, or outside the tape that computes the gradients, counts nothing.
"""

import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

SCALED, ZERO, OTHER, MIXED = "scaled", "zero", "other", "mixed"
_SUMS = ("Add", "AddV2", "AddN", "Sub", "AccumulateNV2")
_ZEROS = ("ZerosLike", "Zeros")
_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
_CONDS = ("If", "StatelessIf")
_LOOPS = ("While", "StatelessWhile")


def combine(kinds: Sequence[str]) -> str:
    """The kind of a sum of terms of these kinds (also of a value that is one of them:
    the branches of a cond, a loop variable's initial and next value)."""
    kinds = set(kinds)
    if MIXED in kinds or (SCALED in kinds and OTHER in kinds):
        return MIXED
    if SCALED in kinds:
        return SCALED
    return ZERO if kinds <= {ZERO} else OTHER


def _flow(kinds: Sequence[str]) -> str:
    """The kind of any other op's output: scaled if an input is (a product with the scale)."""
    kinds = set(kinds)
    if MIXED in kinds:
        return MIXED
    if SCALED in kinds:
        return SCALED
    return ZERO if kinds and kinds <= {ZERO} else OTHER


def _is_zero_constant(op: tf.Operation) -> bool:
    try:
        value = tf.make_ndarray(op.get_attr("value"))
    except Exception:  # pylint: disable=broad-except  (a string or resource constant)
        return False
    return value.dtype != object and not np.any(value)


class _Walk:
    """Kinds of tensors in graphs (module docstring); one per check, memoised per
    graph and binding of its inputs."""

    def __init__(self, scale_names: Callable[[tf.Graph], set]):
        self._scale_names = scale_names
        self._calls: Dict[Tuple[int, Tuple[str, ...]], List[str]] = {}

    def kinds(self, graph: tf.Graph, targets: Sequence[tf.Tensor], inputs: Optional[Dict[str, str]] = None
              ) -> List[str]:
        """The kinds of `targets` (tensors of `graph`), its placeholders bound by name to
        `inputs` (unbound ones are OTHER)."""
        inputs = inputs or {}
        scales = self._scale_names(graph)
        memo: Dict[str, str] = {}
        for target in targets:
            stack = [target]
            while stack:  # iterative post-order: graphs are deep
                tensor = stack[-1]
                if tensor.name in memo:
                    stack.pop()
                    continue
                op = tensor.op
                if tensor.name in scales:
                    memo[tensor.name] = SCALED
                elif op.type == "Placeholder":
                    memo[tensor.name] = inputs.get(tensor.name, OTHER)
                elif op.type == "Const":
                    memo[tensor.name] = ZERO if _is_zero_constant(op) else OTHER
                elif op.type in _ZEROS:
                    memo[tensor.name] = ZERO
                else:
                    pending = [t for t in op.inputs if t.name not in memo]
                    if pending:
                        stack.extend(pending)
                        continue
                    memo[tensor.name] = self._of_op(tensor, [memo[t.name] for t in op.inputs])
                stack.pop()
        return [memo[t.name] for t in targets]

    def _of_op(self, tensor: tf.Tensor, input_kinds: List[str]) -> str:
        op = tensor.op
        if op.type in _SUMS:
            return combine(input_kinds)
        if op.type == "Fill":  # Fill(dims, value)
            return input_kinds[1]
        body = None
        try:
            if op.type in _CALLS:
                body = _function_graph(op, "f")
                if body is not None:
                    return self._call(body, input_kinds)[tensor.value_index]
            elif op.type in _CONDS:
                branches = [_function_graph(op, a, c) for a, c in (("then_branch", "_true_graph"),
                                                                   ("else_branch", "_false_graph"))]
                if all(b is not None for b in branches):
                    return combine([self._call(b, input_kinds[1:])[tensor.value_index] for b in branches])
            elif op.type in _LOOPS:
                body = _function_graph(op, "body", "_body_graph")
                if body is not None:
                    return self._loop(body, input_kinds)[tensor.value_index]
        except (ValueError, IndexError, KeyError):
            pass  # a graph that does not look as expected: judged by its inputs, as below
        return _flow(input_kinds)

    def _call(self, body: tf.Graph, input_kinds: Sequence[str]) -> List[str]:
        key = (id(body), tuple(input_kinds))
        if key not in self._calls:
            bound = {p.name: k for p, k in zip(body.inputs, input_kinds, strict=True)}
            self._calls[key] = self.kinds(body, body.outputs, bound)
        return self._calls[key]

    def _loop(self, body: tf.Graph, initial: Sequence[str]) -> List[str]:
        kinds = list(initial)
        for _ in range(8):  # the lattice is 4 deep: a fixed point within a few rounds
            after = [combine((first, out)) for first, out in zip(initial, self._call(body, kinds), strict=True)]
            if after == kinds:
                break
            kinds = after
        return kinds


def _function_graph(op: tf.Operation, attr: str, cached: Optional[str] = None) -> Optional[tf.Graph]:
    """The FuncGraph an op calls (attr names the function): the one traced, where the
    scales were recorded."""
    graph = getattr(op, cached, None) if cached else None
    if graph is not None:
        return graph
    function = op.graph._get_function(op.get_attr(attr).name)  # pylint: disable=protected-access
    return getattr(function, "graph", None) if function is not None else None


class ScaleProvenance:
    """The scales that `scale_loss` and `minimize` made, and a check that gradients come
    from one (module docstring)."""

    def __init__(self):
        self._scales = weakref.WeakKeyDictionary()  # graph -> names of the scale tensors made in it
        self._eager_passes = 0
        self._lock = threading.Lock()

    def record(self, scale: tf.Tensor) -> None:
        """Records a scale tensor made while tracing (eagerly: nothing, see `scaled_loss`)."""
        if not tf.executing_eagerly():
            self._scales.setdefault(scale.graph, set()).add(scale.name)

    def count_backward_pass(self) -> None:
        """Counts an eager gradient computation that went through a scale."""
        with self._lock:
            self._eager_passes += 1

    def scaled_loss(self, loss: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        """loss * scale; eagerly, under a gradient that counts the backward passes through it."""
        if not tf.executing_eagerly():
            return loss * scale

        @tf.custom_gradient
        def scaled(x):
            def grad(upstream):
                self.count_backward_pass()
                return upstream * scale
            return x * scale, grad
        return scaled(loss)

    def check(self, grads: Sequence[tf.Tensor]) -> Tuple[List[int], List[int]]:
        """(indices of gradients of an unscaled loss, indices of gradients of a partly
        scaled one). Eagerly: all unscaled unless a backward pass went through a scale
        since the last update."""
        if tf.executing_eagerly():
            with self._lock:
                if self._eager_passes == 0:
                    return list(range(len(grads))), []
                self._eager_passes -= 1
            return [], []
        walk = _Walk(lambda graph: self._scales.get(graph, set()))
        by_graph: Dict[tf.Graph, List[int]] = {}
        for i, g in enumerate(grads):
            by_graph.setdefault(g.graph, []).append(i)
        kinds = [OTHER] * len(grads)
        for graph, indices in by_graph.items():
            for i, kind in zip(indices, walk.kinds(graph, [grads[i] for i in indices]), strict=True):
                kinds[i] = kind
        return ([i for i, k in enumerate(kinds) if k == OTHER], [i for i, k in enumerate(kinds) if k == MIXED])
