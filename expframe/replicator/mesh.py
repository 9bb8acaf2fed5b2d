"""The `mesh` target: a DTensor mesh with named axes (`batch` x `model`) over devices.

Only `expframe/replicator/` touches the distribution machinery. Layers get their
layouts from the small API here (`layout`, `variable`, `model_axis_size`,
`check_divisible`), never from `tf.experimental.dtensor` or `tf.distribute` directly.

On a mesh every step is one SPMD program: TensorFlow's DTensor pass partitions each
op by the layouts of its inputs and inserts the collectives a layout change needs
(e.g. the all-reduce over `model` after a row-parallel matmul whose contracted
dimension is sharded). Data is sharded over `batch`; `model` splits the kernels.

Example:
  mesh = make_mesh({"batch": 2, "model": 2})
  with use_mesh(mesh):
      w = variable(lambda: tf.ones([8, 16]), axes=(None, "model"))   # columns split
      x = shard_batch(tf.ones([4, 8]))                                # rows split
      y = tf.matmul(x, w)                                             # layout [batch, model]
"""

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from expframe.errors import ConfigError
from expframe.replicator import targets

BATCH = "batch"
MODEL = "model"
_BINDING = "Replicator.mesh_shape"

_current: List[dtensor.Mesh] = []


def mesh_devices(num_devices: int, mesh_shape: Optional[Dict[str, int]] = None) -> List[str]:
    """`num_devices` device names: the GPUs when TensorFlow sees any, else logical CPUs
    (the `cpu` target's split, at most `targets.MAX_CPU_DEVICES` unless raised
    explicitly). Raises ConfigError naming `Replicator.mesh_shape`."""
    # Physical first: listing logical devices starts the runtime, after which the CPU
    # can no longer be split.
    gpus = tf.config.list_physical_devices("GPU") and tf.config.list_logical_devices("GPU")
    if gpus:
        if num_devices > len(gpus):
            raise ConfigError(
                f"{_BINDING} asks for {num_devices} devices but only {len(gpus)} GPU(s) are visible; "
                f"make the product of the mesh axes <= {len(gpus)}.")
        return [g.name for g in gpus[:num_devices]]
    shown = f"{_BINDING}={mesh_shape!r}" if mesh_shape is not None else _BINDING
    targets.check_cpu_device_count(num_devices, shown,
                                   f"make the product of the mesh axes <= {targets.MAX_CPU_DEVICES}")
    try:
        return targets.cpu_devices(num_devices)
    except ConfigError as e:
        raise ConfigError(f"{_BINDING} asks for {num_devices} devices: {e}") from None


def make_mesh(mesh_shape: Dict[str, int], devices: Optional[Sequence[str]] = None) -> dtensor.Mesh:
    """A DTensor mesh of shape `mesh_shape` (axis name -> size, in order) over `devices`.

    Args:
      mesh_shape: e.g. {"batch": 2, "model": 2}; must name the axes `batch` and `model`
        (a size of 1 leaves that kind of parallelism off).
      devices: device names, exactly as many as the product of the sizes (default:
        `mesh_devices(product)`).

    Raises:
      ConfigError: a malformed shape, or a device count that does not match it.
    """
    if not isinstance(mesh_shape, dict) or set(mesh_shape) != {BATCH, MODEL}:
        raise ConfigError(
            f"{_BINDING}={mesh_shape!r} must be a dict with the axes 'batch' and 'model', "
            "e.g. {'batch': 2, 'model': 2}.")
    for name, size in mesh_shape.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{_BINDING}['{name}']={size!r} must be a positive integer.")
    size = int(np.prod(list(mesh_shape.values())))
    if devices is None:
        devices = mesh_devices(size, mesh_shape)
    devices = list(devices)
    if len(devices) != size:
        raise ConfigError(
            f"{_BINDING}={mesh_shape!r} has {size} positions but {len(devices)} device(s) were "
            f"given; make the product of the axis sizes equal {len(devices)}.")
    return dtensor.create_mesh(list(mesh_shape.items()), devices=devices)


@contextlib.contextmanager
def use_mesh(mesh: dtensor.Mesh) -> Iterator[dtensor.Mesh]:
    """Makes `mesh` the current one: `layout` and `variable` use it, and ops on plain
    tensors run on it."""
    _current.append(mesh)
    try:
        with dtensor.default_mesh(mesh):
            yield mesh
    finally:
        _current.pop()


def current_mesh() -> dtensor.Mesh:
    """The mesh of the innermost `use_mesh` (or `Replicator.scope()` on the mesh target)."""
    if not _current:
        raise RuntimeError("no mesh is current: build mesh layers inside Replicator.scope() "
                           "of a Replicator(target='mesh'), or inside mesh.use_mesh(mesh).")
    return _current[-1]


def axis_size(axis: str, mesh: Optional[dtensor.Mesh] = None) -> int:
    """The size of a mesh axis (1 when the mesh has no such axis)."""
    mesh = mesh or current_mesh()
    return mesh.dim_size(axis) if axis in mesh.dim_names else 1


def model_axis_size(mesh: Optional[dtensor.Mesh] = None) -> int:
    """How many ways the `model` axis splits kernels."""
    return axis_size(MODEL, mesh)


def layout(axes: Sequence[Optional[str]], mesh: Optional[dtensor.Mesh] = None) -> dtensor.Layout:
    """The layout of a tensor whose dimension i is split over mesh axis `axes[i]`
    (None: not split, every device holds it whole)."""
    mesh = mesh or current_mesh()
    return dtensor.Layout([dtensor.UNSHARDED if a is None else a for a in axes], mesh)


def check_divisible(size: int, binding: str, axis: str = MODEL, what: str = "") -> None:
    """ConfigError naming `binding` unless `size` divides evenly over mesh axis `axis`."""
    n = axis_size(axis)
    if size % n:
        raise ConfigError(
            f"{binding}={size}{' (' + what + ')' if what else ''} is not divisible by the mesh's "
            f"'{axis}' axis of size {n} ({_BINDING}); use a multiple of {n} or a smaller '{axis}' axis.")


def put(value, axes: Sequence[Optional[str]], mesh: Optional[dtensor.Mesh] = None) -> tf.Tensor:
    """A host tensor (or DTensor) laid out on the mesh as `axes` says."""
    target = layout(axes, mesh)
    value = tf.convert_to_tensor(value)
    if not tf.inside_function() and dtensor.is_dtensor(value):  # inside: a host tensor
        return dtensor.relayout(value, target)
    replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(target.mesh, value.shape.rank))
    return dtensor.relayout(replicated, target)


def variable(initial_value: Callable[[], tf.Tensor], axes: Sequence[Optional[str]],
             name: Optional[str] = None, trainable: bool = True) -> dtensor.DVariable:
    """A DTensor variable laid out as `axes` on the current mesh.

    The initial value is computed whole on the host and then split, so that the same
    seed gives the same weights on every mesh shape (and on 1x1).
    """
    return dtensor.DVariable(put(initial_value(), axes), name=name, trainable=trainable)


def variable_like(var: tf.Variable, name: Optional[str] = None) -> dtensor.DVariable:
    """A zero DTensor variable with `var`'s shape, dtype and layout (optimizer slots)."""
    var_layout = dtensor.fetch_layout(var)
    zeros = dtensor.call_with_layout(tf.zeros, var_layout, shape=var.shape.as_list(), dtype=var.dtype)
    return dtensor.DVariable(zeros, name=name, trainable=False)


def shard_batch(value) -> tf.Tensor:
    """A host batch (tensor) split over the `batch` axis on its first dimension."""
    value = tf.convert_to_tensor(value)
    return put(value, [BATCH] + [None] * (value.shape.rank - 1))


def replicate(value) -> tf.Tensor:
    """A tensor held whole by every device of the current mesh."""
    value = tf.convert_to_tensor(value)
    return put(value, [None] * value.shape.rank)


def to_host(value) -> np.ndarray:
    """The full value of a DTensor (or plain tensor) as a numpy array."""
    if isinstance(value, tf.Variable):
        value = value.read_value()
    if not tf.inside_function() and dtensor.is_dtensor(value):  # inside: a host tensor
        value = dtensor.relayout(value, dtensor.Layout.replicated(dtensor.fetch_layout(value).mesh,
                                                                   value.shape.rank))
        value = dtensor.unpack(value)[0]
    return np.asarray(value)


def shard_shapes(value) -> List[tuple]:
    """The shapes of the pieces each device of the mesh holds, in device order."""
    if isinstance(value, tf.Variable):
        value = value.read_value()
    return [tuple(t.shape) for t in dtensor.unpack(value)]


def axes_of(value) -> List[Optional[str]]:
    """The mesh axis each dimension of a DTensor is split over (None: not split)."""
    if isinstance(value, tf.Variable):
        value = value.read_value()
    specs = dtensor.fetch_layout(value).sharding_specs
    return [None if s == dtensor.UNSHARDED else s for s in specs]


def relayout(value: tf.Tensor, axes: Sequence[Optional[str]], mesh: Optional[dtensor.Mesh] = None) -> tf.Tensor:
    """`value` (a DTensor on `mesh`, default the current one) laid out as `axes`.
    Making a dimension whole that a contraction split (partial sums) is the
    all-reduce over that mesh axis. Works eagerly and inside tf.function."""
    return dtensor.relayout(value, layout(axes, mesh))
