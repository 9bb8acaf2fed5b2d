"""What one training step is made of, measured on this machine from the experiment itself.

The experiment is built through its own gin files (the same configurables `main.py`
builds before its first step) on one CPU replica in float32, at two small per-replica
batches; its train step is traced through `Replicator.run` (nothing is executed), and:

* FLOPs: TensorFlow's profiler (`tf.compat.v1.profiler`, `float_operation`) over the
  traced graph, i.e. the ops' registered FLOP statistics: 2 m n k for a MatMul, 2 x
  output elements x kernel volume x input channels for a convolution and both of its
  gradients, one per element for element-wise ops. XLA's cost analysis is not exposed
  by TF 2.21's Python API on CPU, so the profiler it is.
* activation bytes: the forward tensors the backward pass reads (outputs of forward ops
  consumed by backward ops: those under `gradient_tape/` and everything computed from
  them, such as the gradient sums TensorFlow names `AddN` at the top level), at float32;
  for ResNet-50 this is the per-layer sum of the tensors its layers save (84 MB per
  224-px image, tests/plan/test_measure.py);
* collectives: what the step all-reduces through `expframe.replicator.collectives`
  (every optimizer update's gradients: a GAN's `disc_steps` discriminator updates and
  its generator update) and every training-mode `SyncBatchNorm` call (its channels, its
  group size, and whether the step differentiates through it, which adds its
  all-reduce's backward), both recorded while the step is traced;
* kernels under XLA: convolutions, matmuls and their gradients, each with a fusion
  around it, and one fused update per trained variable (what a compiled step launches);
* parameter, gradient and slot bytes: the model's variables, the trainable ones (what
  is all-reduced), and the optimizers' own variables.

FLOPs and activations are fitted as a + b x batch from the two traces. This module
imports TensorFlow; the planner's CLI imports it only after the flags were checked.
"""

import contextlib
import re
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import tensorflow as tf

from expframe import config, epochs
from expframe.errors import ConfigError
from expframe.plan.model import Footprint
from expframe.trainer import accumulate_steps_of

PROBE_BATCHES = (2, 4)
# Train-split sizes of datasets whose examples the planner does not read (it builds their
# input on mock data): ILSVRC 2012's train split (Russakovsky et al. 2015) is 1,281,167 images.
KNOWN_TRAIN_EXAMPLES = {"imagenet_input": 1_281_167}


def _query(binding: str, default=None):
    try:
        value = gin.query_parameter(binding)
    except ValueError:
        return default
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
        return value.scoped_configurable_fn()
    return value


def experiment_settings(gin_files: Sequence[str], gin_params: Sequence[str]) -> Dict:
    """The experiment's own settings (as its gin files and bindings give them); gin's
    config is left empty, as found by a fresh process."""
    gin.clear_config()
    try:
        config.parse(list(gin_files), list(gin_params))
        settings = _settings(gin_files, gin.config_str())
    finally:
        gin.clear_config()
    if not settings["global_batch_size"]:
        raise ConfigError(f"{', '.join(gin_files)}: binds no Trainer.global_batch_size; the planner plans a "
                          "training run (pass it with --gin_param).")
    epochs.check_bindings({"train": settings["train_steps"]}, {"train": settings["train_epochs"]})
    return settings


def _settings(gin_files: Sequence[str], text: str) -> Dict:
    return {
        "target": _query("Replicator.target", "cpu"), "num_replicas": _query("Replicator.num_replicas"),
        "mesh_shape": _query("Replicator.mesh_shape"), "precision": _query("run_experiment.precision", "float32"),
        "jit_compile": _query("Replicator.jit_compile", "auto"),
        "global_batch_size": _query("Trainer.global_batch_size"), "train_steps": _query("Trainer.train_steps"),
        "train_epochs": _query("Trainer.train_epochs"),
        "steps_per_loop": _query("Trainer.steps_per_loop", 100),
        "samples_per_insert": _query("D4PGTask.samples_per_insert"), "num_actors": _query("D4PGTask.num_actors", 0),
        "uses": [name for name in KNOWN_TRAIN_EXAMPLES if f"{name}." in text or f"@{name}" in text],
        "train_input": _reference_name(_query("ClassificationTask.dataset")),
        "mock_input": bool(_query("imagenet_input.use_mock", False)),
        "d4pg": "D4PGTask" in text, "gan": "GANTask." in text, "gin_files": list(gin_files)}


def _reference_name(value) -> Optional[str]:
    """The configurable a gin reference (`@imagenet_input`) names, without its module; None
    for anything else (unbound, a value)."""
    if isinstance(value, gin.config.ConfigurableReference):
        return value.selector.split(".")[-1]
    return None


def _overrides(settings: Dict) -> List[str]:
    """Bindings that build the experiment on one CPU replica in float32, offline."""
    if settings["target"] == "mesh":
        out = ["Replicator.mesh_shape = {'batch': 1, 'model': 1}"]
    else:
        out = ["Replicator.target = 'cpu'", "Replicator.num_replicas = 1"]
    out += ["run_experiment.precision = 'float32'", "Replicator.jit_compile = False"]
    if "imagenet_input" in settings["uses"]:
        out += ["imagenet_input.use_mock = True", "imagenet_input.mock_num_examples = 8"]
    if settings["d4pg"]:
        out += ["D4PGTask.num_actors = 0"]
    if settings["gan"]:
        out += ["GANTask.feature_network = None"]  # eval metrics only: no Inception graph or classifier to train
    return out


def _built(gin_files, gin_params, settings, batch: int):
    """(replicator, task) built as `Trainer.prepare` builds them, at global batch `batch` on one replica."""
    from expframe.replicator import Replicator  # pylint: disable=import-outside-toplevel
    from expframe.tasks.base import Task  # pylint: disable=import-outside-toplevel
    gin.clear_config()
    config.parse(list(gin_files), list(gin_params) + _overrides(settings))
    reference = gin.query_parameter("run_experiment.task")
    task = reference.scoped_configurable_fn() if hasattr(reference, "scoped_configurable_fn") else reference
    if not isinstance(task, Task):
        raise ConfigError(f"run_experiment.task must be a Task (e.g. @ClassificationTask()), got {task!r}.")
    replicator = Replicator()
    task.setup(replicator, batch, 0, False)
    with replicator.scope():
        task.build()
    return replicator, task


def _spec(dataset: tf.data.Dataset):
    """The shapes of one train element: the dataset's spec where it is static, else those of
    its first element (e.g. a GAN's disc_steps x batch sub-batches, batched without a static size)."""
    spec = dataset.element_spec
    if all(s.shape.is_fully_defined() for s in tf.nest.flatten(spec)):
        return spec
    element = next(iter(dataset.take(1)))
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), element)


def _graph(replicator, task) -> tf.Graph:
    spec = _spec(task.train_input_fn(tf.distribute.InputContext()))
    step = tf.function(lambda element: replicator.run(task.train_step, element))
    return step.get_concrete_function(spec).graph


def _nbytes(structure) -> float:
    return float(sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(structure)
                     if isinstance(t, (tf.Tensor, tf.Variable)) and t.shape.is_fully_defined()))


@contextlib.contextmanager
def recording_collectives():
    """While tracing: every `collectives.all_reduce` call ({'bytes', 'op'}) and every
    training-mode `SyncBatchNorm` call ({'channels', 'scope'}), in the order the step makes
    them. On one replica neither communicates, but the calls are the step's own: the
    optimizer's all-reduce of each update's gradients, each batch norm's gather."""
    from expframe.layers.sync_batch_norm import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    from expframe.replicator import collectives  # pylint: disable=import-outside-toplevel
    record = {"all_reduce": [], "sync_bn": []}
    all_reduce, call = collectives.all_reduce, SyncBatchNorm.call

    inside_norm = []

    def recorded_all_reduce(x, op="sum", group_size=None):
        if not inside_norm:  # a batch norm's own sums are priced per call (sync_bn), not here
            record["all_reduce"].append({"bytes": _nbytes([tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]),
                                         "op": op})
        return all_reduce(x, op, group_size=group_size)

    def recorded_call(layer, inputs, training=None, mask=None):
        if training and layer.trainable:
            axis = layer.axis if isinstance(layer.axis, int) else layer.axis[-1]
            record["sync_bn"].append({"channels": int(inputs.shape[axis]), "scope": tf.get_current_name_scope(),
                                      "group_size": layer.group_size})
        inside_norm.append(layer)
        try:
            return call(layer, inputs, training=training, mask=mask)
        finally:
            inside_norm.pop()

    collectives.all_reduce, SyncBatchNorm.call = recorded_all_reduce, recorded_call
    try:
        yield record
    finally:
        collectives.all_reduce, SyncBatchNorm.call = all_reduce, call


def sync_bn_calls(graph: tf.Graph, calls: List[Dict]) -> List[Tuple[int, bool, Optional[int]]]:
    """(channels, backward, group size) per recorded SyncBatchNorm call: backward when the
    step differentiates through the call (an op of its scope under `gradient_tape/`), which
    adds the gradient of its all-reduce, as many floats over the same replicas."""
    names = [op.name for op in graph.get_operations() if _BACKWARD.search(op.name)]
    out = []
    for c in calls:
        prefix = f"gradient_tape/{c['scope']}/" if c["scope"] else None
        out.append((c["channels"], bool(prefix) and any(prefix in name for name in names), c.get("group_size")))
    return out


def graph_flops(graph: tf.Graph) -> float:
    """FLOPs of every op in `graph` with registered FLOP statistics (tf.compat.v1.profiler).

    The profiler also logs the graph's trainable-variables collection, which a traced
    function's graph shares with the process's default graph: variables made eagerly
    before (a MirroredStrategy's, by any earlier code in the process) have no graph op and
    fail it. They count no FLOPs, so the collection is emptied while it profiles."""
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    trainable = graph.get_collection_ref(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    saved = list(trainable)
    del trainable[:]
    try:
        return float(tf.compat.v1.profiler.profile(graph, options=options).total_float_ops)
    finally:
        trainable[:] = saved


_NOT_RUN = ("Const", "NoOp", "Placeholder", "VarHandleOp", "Identity", "Shape")
# Ops XLA lowers to a library call of their own (cuDNN, cuBLAS) or a kernel of their own.
_HEAVY = re.compile(r"^(Conv\dD|Conv\dDBackprop\w+|DepthwiseConv2dNative\w*|MatMul|BatchMatMul\w*|"
                    r"FusedBatchNorm\w*|Einsum)$")


def graph_ops(graph: tf.Graph) -> int:
    """Ops the executor dispatches per step (constants, placeholders and identities left out;
    Grappler's fusions at run time make the real count somewhat lower)."""
    return sum(1 for op in graph.get_operations() if op.type not in _NOT_RUN)


def compiled_kernels(graph: tf.Graph, trained_variables: int) -> int:
    """Kernels a step compiled by XLA launches, estimated: each convolution, matmul and
    their gradients (a library call) with one fusion of the element-wise work around it,
    and one fused update per trained variable."""
    heavy = sum(1 for op in graph.get_operations() if _HEAVY.match(op.type))
    return 2 * heavy + trained_variables


_BACKWARD = re.compile(r"(^|/)gradient_tape/")


def backward_ops(graph: tf.Graph) -> set:
    """Names of the backward pass's ops: those under `gradient_tape/` and every op computed
    from them (TensorFlow names some gradient sums `AddN_k` at the top level; the optimizer's
    updates follow too)."""
    seen = {op.name for op in graph.get_operations() if _BACKWARD.search(op.name)}
    todo = [graph.get_operation_by_name(name) for name in seen]
    while todo:
        op = todo.pop()
        for tensor in op.outputs:
            for consumer in tensor.consumers():
                if consumer.name not in seen:
                    seen.add(consumer.name)
                    todo.append(consumer)
    return seen


def saved_activation_bytes(graph: tf.Graph) -> float:
    """Bytes of the forward tensors the backward pass reads: outputs of forward ops computed
    from the step's inputs (its data, not its variables: parameters are counted apart)
    consumed by a backward op (`backward_ops`), the inputs themselves included. Each
    tensor once."""
    backward = backward_ops(graph)
    inputs = [op for op in graph.get_operations()
              if op.type == "Placeholder" and op.outputs and op.outputs[0].dtype != tf.resource]
    data, todo = {op.name for op in inputs}, list(inputs)
    while todo:
        op = todo.pop()
        for tensor in op.outputs:
            for consumer in tensor.consumers():
                if consumer.name not in data and consumer.name not in backward:
                    data.add(consumer.name)
                    todo.append(consumer)
    total = 0.0
    for op in graph.get_operations():
        if op.name not in data or op.type in ("Const", "Shape"):
            continue
        for tensor in op.outputs:
            if tensor.dtype == tf.resource or not tensor.shape.is_fully_defined():
                continue
            if any(consumer.name in backward for consumer in tensor.consumers()):
                total += tensor.shape.num_elements() * tensor.dtype.size
    return total


def _variables_bytes(variables) -> Tuple[float, int]:
    seen, total, count = set(), 0.0, 0
    for v in variables:
        key = id(v)
        if key in seen:
            continue
        seen.add(key)
        count += int(v.shape.num_elements())
        total += int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size
    return total, count


def variable_bytes(trackables: Dict) -> Dict[str, float]:
    """params / grads / slots bytes of a task's trackables: Keras models' weights (tf.Module
    models' variables), the variables the optimizers update (their gradients are what is
    all-reduced), and every optimizer's own variables (moments, iterations, accumulators)."""
    import keras  # pylint: disable=import-outside-toplevel
    models, modules, slot_variables, updated = [], [], [], []

    def visit(obj):
        if isinstance(obj, keras.Model):
            models.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)
        elif isinstance(obj, keras.optimizers.Optimizer):
            slot_variables.extend(obj.variables)
            updated.extend(getattr(obj, "_trainable_variables", []))  # what it was built for (Keras 3)
        elif isinstance(getattr(obj, "optimizer", None), keras.optimizers.Optimizer):  # wrap_optimizer's wrapper
            visit(obj.optimizer)
            slot_variables.extend(obj.variables)  # its own: accumulators, loss scale
        elif isinstance(obj, tf.Module) and (hasattr(obj, "apply_gradients") or hasattr(obj, "slots")):  # MeshAdam
            slot_variables.extend(obj.variables)
        elif isinstance(obj, tf.Module):  # a tf.Module model (the mesh's ViT)
            modules.append(obj)

    visit(trackables)
    params, count = _variables_bytes([w for m in models for w in m.weights] + [v for m in modules for v in m.variables])
    # Gradients: of the variables the optimizers update (not, e.g., D4PG's target networks).
    grads, _ = _variables_bytes(updated or [w for m in models for w in m.trainable_weights]
                                + [v for m in modules for v in m.trainable_variables])
    slots, _ = _variables_bytes(slot_variables)
    trained = len({id(v) for v in updated}) or sum(len(m.trainable_weights) for m in models)
    return {"params": params, "grads": grads, "slots": slots, "num_params": count, "trained_variables": trained}


def footprint(gin_files: Sequence[str], gin_params: Sequence[str], settings: Dict,
              probe_batches: Sequence[int] = PROBE_BATCHES) -> Tuple[Footprint, Dict]:
    """Measures the experiment's step: (Footprint, details) with the traces' raw numbers;
    gin's config is left empty (the experiment was parsed with the planner's overrides)."""
    try:
        return _footprint(gin_files, gin_params, settings, probe_batches)
    finally:
        gin.clear_config()


def _footprint(gin_files, gin_params, settings, probe_batches) -> Tuple[Footprint, Dict]:
    flops, activations, ops, details = [], [], 0, {"probe_batches": list(probe_batches)}
    for batch in probe_batches:
        replicator, task = _built(gin_files, gin_params, settings, batch)
        with recording_collectives() as record:
            graph = _graph(replicator, task)
        flops.append(graph_flops(graph))
        activations.append(saved_activation_bytes(graph))
        ops = graph_ops(graph)
    (b1, b2), (f1, f2), (a1, a2) = probe_batches, flops, activations
    per_flops, per_act = (f2 - f1) / (b2 - b1), (a2 - a1) / (b2 - b1)
    sizes = variable_bytes(task.trackables())
    sync_bn = sync_bn_calls(graph, record["sync_bn"])
    mesh = settings.get("mesh_shape") or {}
    fp = Footprint(flops_fixed=max(0.0, f1 - per_flops * b1), flops_per_example=per_flops,
                   param_bytes=sizes["params"], grad_bytes=sizes["grads"], slot_bytes=sizes["slots"],
                   activation_bytes_fixed=max(0.0, a1 - per_act * b1), activation_bytes_per_example=per_act,
                   num_params=sizes["num_params"], sync_collectives=len(sync_bn), ops=ops,
                   examples_per_step_factor=task.examples_per_step / task.global_batch_size,
                   precision=settings["precision"], model_axis=int(mesh.get("model", 1)),
                   all_reduce_bytes=[r["bytes"] for r in record["all_reduce"]],
                   sync_bn=[list(call) for call in sync_bn],
                   compiled_kernels=compiled_kernels(graph, sizes["trained_variables"]),
                   jit_compile=settings.get("jit_compile", "auto"), target=settings.get("target", "cpu"))
    details.update(flops=flops, activation_bytes=activations, examples_per_epoch=_examples_per_epoch(task, settings),
                   accumulate_steps=accumulate_steps_of(task))
    if settings["d4pg"]:
        details["actor_env_steps_per_s"] = actor_env_steps_per_s(task)
    return fp, details


def actor_env_steps_per_s(task, env_steps: int = 300) -> float:
    """One D4PG actor's environment steps/s on this machine: the task's own synchronous
    actor (policy network, exploration noise, environment, replay adder), timed."""
    import time  # pylint: disable=import-outside-toplevel
    task.actor.update(task.acting_weights())
    task.actor.run(20)  # traces the policy
    start = time.perf_counter()
    task.actor.run(env_steps)
    return env_steps / (time.perf_counter() - start)


def _examples_per_epoch(task, settings: Dict) -> Optional[int]:
    for name in settings["uses"]:
        return KNOWN_TRAIN_EXAMPLES[name]
    counter = getattr(task, "train_examples", None)
    try:
        return counter() if callable(counter) else None
    except (ConfigError, tf.errors.OpError, TypeError, ValueError):
        return None
