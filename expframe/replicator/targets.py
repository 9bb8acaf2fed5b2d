"""Target names -> `tf.distribute.Strategy` objects (the contract table in DESIGN.md).

Only this package touches `tf.distribute`. Every failure to build a target is a
`ConfigError` naming the binding and the fix, never a deep TensorFlow trace.
"""

import json
import os
from typing import NamedTuple, Optional

import gin
import tensorflow as tf
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver

from expframe.errors import ConfigError
from expframe.replicator import cluster

TARGETS = ("cpu", "gpu", "tpu", "multi_worker", "parameter_server", "mesh", "auto")

# How many logical CPU devices the process's CPU is split into the first time a
# multi-replica `cpu` Replicator is created. TensorFlow allows the split only once,
# before the runtime starts, so we split generously: Replicators of any size up to
# this number can then be created one after another in the same process.
_CPU_DEVICES_ENV = "EXPFRAME_CPU_DEVICES"
_DEFAULT_CPU_DEVICES = 8
# The most logical CPU devices a binding may ask for unless EXPFRAME_CPU_DEVICES (or
# expframe.split_cpu) asks for more explicitly. Each logical device brings its own
# threads and buffers: `Replicator.mesh_shape = {'batch': 64, 'model': 64}` asked for
# 4,096 of them, and the process grew to 11 GB and 16,000 threads in 5 minutes
# without failing or training.
MAX_CPU_DEVICES = 64


# Inter-op threads that host-side services of this process hold blocked while a step
# runs (see reserve_inter_op_threads).
_reserved_threads = [0]
# Logical CPU devices of the first split when nothing says how many (see split_only_for).
_default_devices = [_DEFAULT_CPU_DEVICES]


def inter_op_threads(num_replicas: int, cores: int, reserved: int = 0) -> int:
    """The inter-op pool the cpu target sets when it splits the CPU: max(cores,
    2 x replicas + reserved), sized by the replicas that run, not by the logical devices
    split for later Replicators (8 by default).

    The pool was once max(cores, 2 x devices): 16 threads for every run on a 2-core CPU,
    one replica included, after ResNet-50 on 2 replicas stalled with the default pool
    (since then the small collectives became each replica's own ops: ResNet-50 with
    SyncBatchNorm on 2 replicas and the quickstart on 8 now train with a pool of 1). More threads than cores
    cost speed, and that pool was the larger part of what a run through main.py paid
    against Keras fit in its own process (TensorFlow's default: the cores). Measured
    with benchmarks/fit_gap.py --inter_op N, ResNet-50 128 px, 2-core Xeon: 1 replica
    9.6 images/s with 16 threads, 10.2 with 4, 10.6 with 2; 2 replicas 6.7-7.0 with
    16, 7.4-7.6 with 4, 7.7 with 2 (docs/hardware.md). Twice the replicas is kept as
    headroom for replicas that wait on each other."""
    return max(cores, 2 * num_replicas + reserved)


def split_only_for(num_replicas: int) -> None:
    """Makes the first cpu split make `num_replicas` logical devices instead of 8, for a
    process that builds no larger Replicator later: run_experiment, which builds the one
    its gin binds. Devices beyond the replicas cost speed: ResNet-50 at 128 px on one
    replica ran 7.5 % faster (0.928, 0.892-0.949, of the speed with 2 devices over 8,
    benchmarks/own_process.py's processes, 2-core Xeon). No effect once TensorFlow has
    started, or where EXPFRAME_CPU_DEVICES (or split_cpu) says how many."""
    _default_devices[0] = max(1, int(num_replicas))


def reserve_inter_op_threads(count: int) -> None:
    """Adds `count` inter-op threads to the pool the cpu target sets when it first splits
    the CPU (call before the first Replicator): for host-side services whose calls hold a
    TensorFlow thread while they wait, as the D4PG learner's actor service does
    (`Task.host_threads`). No effect once TensorFlow has started."""
    _reserved_threads[0] = max(_reserved_threads[0], int(count))


def _explicit_cpu_devices() -> Optional[int]:
    """EXPFRAME_CPU_DEVICES as an integer, None when unset."""
    raw = os.environ.get(_CPU_DEVICES_ENV)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{_CPU_DEVICES_ENV}={raw!r} must be a positive integer (logical CPU devices).")
    return value


def check_cpu_device_count(count: int, binding: str, fix: str) -> None:
    """ConfigError, within milliseconds, when `count` logical CPU devices are more than
    MAX_CPU_DEVICES and EXPFRAME_CPU_DEVICES does not ask for that many explicitly.

    Args:
      count: the logical CPU devices the binding asks for.
      binding: the binding as the user wrote it, e.g. "Replicator.num_replicas=4096".
      fix: what to change it to, e.g. "use Replicator.num_replicas <= 64".
    """
    ceiling = max(MAX_CPU_DEVICES, _explicit_cpu_devices() or 0)
    if count > ceiling:
        raise ConfigError(
            f"{binding} asks for {count} logical CPU devices, more than the ceiling of {ceiling} (each "
            f"device costs threads and memory; 4,096 of them grew to 11 GB without training); {fix}, or set "
            f"{_CPU_DEVICES_ENV}={count} to split the CPU that finely on purpose.")


def cpu_devices(num_replicas: int) -> list:
    """Returns the names of `num_replicas` logical CPU devices, splitting the CPU once.

    Raises:
      ConfigError: more devices than the ceiling (`check_cpu_device_count`), or the
        runtime already started with fewer logical CPUs than asked.
    """
    check_cpu_device_count(num_replicas, f"Replicator.num_replicas={num_replicas} on target 'cpu'",
                           f"use Replicator.num_replicas <= {MAX_CPU_DEVICES}")
    physical = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(physical)
    if configured is None:
        wanted = max(num_replicas, _explicit_cpu_devices() or _default_devices[0])
        try:
            tf.config.set_logical_device_configuration(
                physical, [tf.config.LogicalDeviceConfiguration() for _ in range(wanted)])
            if tf.config.threading.get_inter_op_parallelism_threads() == 0:
                tf.config.threading.set_inter_op_parallelism_threads(
                    inter_op_threads(num_replicas, os.cpu_count() or 1, _reserved_threads[0]))
        except RuntimeError:
            pass  # Runtime already initialised: we get whatever devices exist.
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < num_replicas:
        raise ConfigError(
            f"Replicator.num_replicas={num_replicas} on target 'cpu', but TensorFlow already "
            f"started with {len(logical)} logical CPU device(s) and cannot split the CPU again. "
            f"Create the largest Replicator first, or set {_CPU_DEVICES_ENV}={num_replicas} "
            f"(or call expframe.split_cpu({num_replicas})) before any TensorFlow op runs.")
    return [d.name for d in logical[:num_replicas]]


def split_cpu(num_devices: int) -> None:
    """Splits the CPU into `num_devices` logical devices now (call before any TF op)."""
    physical = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(physical) is None:
        os.environ[_CPU_DEVICES_ENV] = str(num_devices)
    cpu_devices(num_devices)


def _cpu_strategy(num_replicas: Optional[int]) -> tf.distribute.Strategy:
    n = 1 if num_replicas is None else num_replicas
    # Reduction through one host device: on a CPU every "device" shares the same
    # memory, so this is a sum over N buffers with no copies across a bus. NCCL is
    # GPU-only and is never selected here.
    return tf.distribute.MirroredStrategy(
        devices=cpu_devices(n), cross_device_ops=tf.distribute.ReductionToOneDevice())


def _gpu_strategy(num_replicas: Optional[int]) -> tf.distribute.Strategy:
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        raise ConfigError(
            "Replicator.target='gpu' but TensorFlow sees no GPU on this machine "
            "(install a CUDA build of TensorFlow, or use Replicator.target='cpu').")
    n = len(gpus) if num_replicas is None else num_replicas
    if n > len(gpus):
        raise ConfigError(
            f"Replicator.num_replicas={n} with target 'gpu', but only {len(gpus)} GPU(s) are "
            f"visible; set Replicator.num_replicas <= {len(gpus)}.")
    return tf.distribute.MirroredStrategy(devices=[g.name for g in gpus[:n]])


def _tpu_strategy(num_replicas: Optional[int]) -> tf.distribute.Strategy:
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        raise ConfigError(
            "Replicator.target='tpu' but no TPU was found "
            f"({str(e).splitlines()[0][:120]}); run on a TPU VM or use Replicator.target='cpu'."
        ) from None
    strategy = tf.distribute.TPUStrategy(resolver)
    _log_cluster_decides("tpu", num_replicas, strategy)
    return strategy


def cluster_spec_from_env() -> dict:
    """Parses and checks `TF_CONFIG`; returns it as a dict. Raises ConfigError."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        if "SLURM_JOB_ID" in os.environ:
            return {}
        raise ConfigError(
            "Replicator.target needs a cluster but TF_CONFIG is not set; start the run "
            "with `python -m expframe.launch --workers=N -- ...` or set TF_CONFIG.")
    try:
        config = json.loads(raw)
        cluster, task = config["cluster"], config["task"]
        members = cluster[task["type"]]
        index = int(task["index"])
        members[index]  # pylint: disable=pointless-statement
        for role, addresses in cluster.items():
            for address in addresses:
                host, port = address.rsplit(":", 1)
                if not host or not 0 < int(port) < 65536:
                    raise ValueError(f"bad address {address!r} for {role}")
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(
            f"TF_CONFIG is not a valid cluster description ({e!r}); it must be JSON like "
            '{"cluster": {"worker": ["127.0.0.1:2222", ...]}, "task": {"type": "worker", '
            '"index": 0}}.') from None
    return config


class _CpuSlurmClusterResolver(slurm_cluster_resolver.SlurmClusterResolver):
    """TensorFlow's SlurmClusterResolver for nodes without GPUs.

    The stock resolver counts GPUs with `nvidia-smi` (missing on CPU nodes: it
    fails), hands every task at least one GPU (with none, it fails on a zero
    step), drops tasks beyond the GPU count of a node, and reports them to the
    strategy as accelerators. Here every task gets a slot that is never used
    (CUDA_VISIBLE_DEVICES is left alone) and no accelerators are reported, so each
    worker runs one replica on its CPU.
    """

    _SLOTS = 1 << 16  # more than any node's task count: no task is dropped.

    def __init__(self, port_base: int):
        super().__init__(port_base=port_base, gpus_per_node=self._SLOTS, gpus_per_task=1, auto_set_gpu=False)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        del task_type, task_id, config_proto
        return {}


@gin.configurable("slurm_cluster")
def slurm_resolver(port_base: int = 8888) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster of this Slurm job step, one worker per Slurm task.

    Reads SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and
    SLURM_STEP_TASKS_PER_NODE; the tasks of a node listen on `port_base`,
    `port_base + 1`, ... (bind `slurm_cluster.port_base` if 8888 is taken).
    """
    try:
        gpus = slurm_cluster_resolver.get_num_gpus()
    except (RuntimeError, OSError):  # no nvidia-smi: a CPU node
        gpus = 0
    try:
        if gpus:
            return slurm_cluster_resolver.SlurmClusterResolver(port_base=port_base)
        return _CpuSlurmClusterResolver(port_base)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"SLURM_JOB_ID is set but the Slurm job step cannot be read ({e}); run "
                          "main.py under `srun`, or set TF_CONFIG for the cluster.") from None


def _resolver():
    if os.environ.get("TF_CONFIG"):
        cluster_spec_from_env()
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if "SLURM_JOB_ID" in os.environ:
        return slurm_resolver()
    cluster_spec_from_env()  # raises the clear error


def _log_cluster_decides(target: str, num_replicas: Optional[int], strategy) -> None:
    if num_replicas is not None:
        print(f"expframe: Replicator.num_replicas={num_replicas} is for the 'cpu' and 'gpu' targets; "
              f"on '{target}' the cluster decides: {strategy.num_replicas_in_sync} replica(s) in sync",
              flush=True)


def _multi_worker_strategy(num_replicas: Optional[int]) -> tf.distribute.Strategy:
    resolver = _resolver()
    cluster.configure_fault_detection(cluster_def=resolver.cluster_spec().as_dict())
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options)
    _log_cluster_decides("multi_worker", num_replicas, strategy)
    return strategy


def _parameter_server_strategy(num_replicas: Optional[int]) -> tf.distribute.Strategy:
    resolver = _resolver()
    cluster.configure_fault_detection(cluster_def=resolver.cluster_spec().as_dict())
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    _log_cluster_decides("parameter_server", num_replicas, strategy)
    return strategy


class WorkerIdentity(NamedTuple):
    """Where this process stands among the processes that run steps."""

    worker_index: int
    num_workers: int
    is_chief: bool


def worker_identity(target: str, strategy: tf.distribute.Strategy) -> WorkerIdentity:
    """This process's index among the workers, their number, and whether it is the chief.

    From the strategy's cluster resolver (task type and id), whichever resolver it
    is (TF_CONFIG, Slurm, ...): a chief task is worker 0 and the workers follow it.
    With parameter servers the program runs on the coordinator alone, which drives
    all workers. Single-process targets are worker 0 of 1.
    """
    if target not in ("multi_worker", "parameter_server"):
        return WorkerIdentity(0, 1, True)
    # ParameterServerStrategy keeps its resolver where the public property does not look (TF 2.21).
    resolver = strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)
    spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
    if target == "parameter_server":
        return WorkerIdentity(0, spec.num_tasks("worker") if "worker" in spec.jobs else 0, True)
    task_type, task_id = resolver.task_type, resolver.task_id
    if not spec.jobs or task_type is None:
        return WorkerIdentity(0, 1, True)
    return WorkerIdentity(multi_worker_util.id_in_cluster(spec, task_type, task_id),
                          multi_worker_util.worker_count(spec, task_type),
                          multi_worker_util.is_chief(spec, task_type, task_id))


def make_strategy(target: str, num_replicas: Optional[int]) -> tf.distribute.Strategy:
    """Builds the strategy for a target name (the `Replicator.target` contract).

    `num_replicas` counts logical CPU devices ('cpu') or GPUs ('gpu'); the
    cluster targets ('multi_worker', 'parameter_server', 'tpu') ignore it with a
    logged line, so that switching the target alone moves an experiment.
    """
    if target not in TARGETS:
        raise ConfigError(
            f"Replicator.target={target!r} is not a known target; use one of "
            f"{', '.join(repr(t) for t in TARGETS)}.")
    if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ConfigError(
            f"Replicator.num_replicas={num_replicas!r} must be a positive integer (or unset).")
    if target == "auto":
        target = auto_target()
    builders = {
        "cpu": _cpu_strategy,
        "gpu": _gpu_strategy,
        "tpu": _tpu_strategy,
        "multi_worker": _multi_worker_strategy,
        "parameter_server": _parameter_server_strategy,
        # One SPMD program over a DTensor mesh (mesh_target.py): no tf.distribute replicas.
        "mesh": lambda _: tf.distribute.get_strategy(),
    }
    return builders[target](num_replicas)


def auto_target() -> str:
    """`tpu` if one is attached, else `gpu` if one is visible, else `cpu`."""
    if os.environ.get("TPU_NAME") or os.path.exists("/dev/accel0"):
        return "tpu"
    if tf.config.list_physical_devices("GPU"):
        return "gpu"
    return "cpu"
