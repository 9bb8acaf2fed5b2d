"""The Replicator: TF-Replicator's programming model on top of `tf.distribute`."""

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Union

import gin
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator import auto_settings, collectives, targets
from expframe.replicator.inputs import DistributedInput, per_replica
from expframe.replicator.mesh_target import MeshTarget
from expframe.replicator.statistics import Statistics
from expframe.replicator.xla_steps import XlaSteps

_REDUCE_OPS = ("sum", "mean", "max", "min")


_AGREE_FNS = {"max": lambda v: collectives.all_reduce(v, "max"),
              "min": lambda v: collectives.all_reduce(v, "min")}


def mean_over_steps(one_step: Callable[[], Any], num_steps) -> Any:
    """Inside a tf.function: calls `one_step()` `num_steps` (>= 1) times in a `tf.range`
    loop and returns its outputs (a nest of tensors) averaged over the calls.

    The first call (before the loop: the loop's variables need the outputs' structure)
    and the loop's body call one nested tf.function, so the step is traced once, not
    twice: tracing is most of a run's start-up."""
    one_step = tf.function(one_step)
    totals = one_step()
    for _ in tf.range(num_steps - 1):
        totals = tf.nest.map_structure(tf.add, totals, one_step())
    return tf.nest.map_structure(lambda t: t / tf.cast(num_steps, t.dtype), totals)


def _as_identical_on_replicas(next_creator, **kwargs):
    if kwargs.get("trainable") is False and (kwargs.get("synchronization") or
                                             tf.VariableSynchronization.AUTO) == tf.VariableSynchronization.AUTO:
        kwargs["synchronization"] = tf.VariableSynchronization.ON_WRITE
    return next_creator(**kwargs)


def identical_updates() -> contextlib.AbstractContextManager:
    """Non-trainable variables created here are updated with the same value on every
    replica by their owner (e.g. SyncBatchNorm's moving statistics, computed from the
    global batch), so Replicator.scope() leaves them unaggregated: no cross-replica
    average on every update."""
    return tf.variable_creator_scope(_as_identical_on_replicas)


@gin.configurable
class Replicator:
    """Runs single-device-looking step functions on many replicas.

    Example:
      rep = Replicator(target="cpu", num_replicas=2)
      with rep.scope():
          model = build_model()
          opt = expframe.wrap_optimizer(keras.optimizers.SGD(0.1))
      it = iter(rep.distribute(input_fn, global_batch_size=256))
      out = rep.run(step_fn, next(it))        # per-replica values
      rep.reduce(out, "mean")                 # {"loss": scalar}

    Args:
      target: 'cpu', 'gpu', 'tpu', 'multi_worker', 'parameter_server' or 'auto'.
      num_replicas: logical CPU devices for 'cpu' (default 1), the first N GPUs
        for 'gpu' (default all); on 'multi_worker', 'parameter_server' and 'tpu' the
        cluster decides, and a value given here is ignored with a logged line (so
        one binding, the target, swaps the hardware).
      mesh_shape: 'mesh' only: {'batch': b, 'model': m}, a DTensor mesh over b x m
        devices (GPUs when present, else the 'cpu' target's logical CPUs); data is
        split over 'batch' (num_replicas = b), kernels of the layers in
        expframe.layers.tensor_parallel over 'model' (see mesh_target.py).
      jit_compile: compile the per-replica train step (what `run_steps` runs) with
        XLA: False, True, or 'auto' (measured on GPUs, off on CPUs; see
        expframe/replicator/auto_settings.py for each target). True where XLA cannot
        work (several logical CPU devices, parameter servers, a mesh) is a ConfigError.
    """

    def __init__(self, target: str = "cpu", num_replicas: Optional[int] = None,
                 mesh_shape: Optional[Dict[str, int]] = None, jit_compile: Union[bool, str] = "auto"):
        self.target = targets.auto_target() if target == "auto" else target
        self.strategy = targets.make_strategy(self.target, num_replicas)
        self.mesh_target = None
        if self.target == "mesh":
            self.mesh_target = MeshTarget({"batch": 1, "model": 1} if mesh_shape is None else mesh_shape)
        elif mesh_shape is not None:
            raise ConfigError(f"Replicator.mesh_shape={mesh_shape!r} is for Replicator.target='mesh' "
                              f"(the target is {self.target!r}); set the target or drop the binding.")
        self.coordinator = None
        if self.target == "parameter_server":
            self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)
        self._identity = targets.worker_identity(self.target, self.strategy)
        self.jit_compile = jit_compile
        self._xla = XlaSteps(jit_compile, self.target, self._local_replicas())
        self._statistics = Statistics()  # scope()'s statistics, one copy after every run()

    def _local_replicas(self) -> int:
        if self.mesh_target is not None or self.coordinator is not None:
            return 1
        return len(self.strategy.extended.worker_devices)

    # -- where we are ----------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """Replicas in sync: all devices on all workers (1 per worker for parameter_server;
        the size of the 'batch' axis on 'mesh')."""
        if self.mesh_target is not None:
            return self.mesh_target.num_replicas
        return self.strategy.num_replicas_in_sync

    @property
    def num_workers(self) -> int:
        """Processes that run steps: hosts for multi_worker, workers for parameter_server, else 1."""
        return self._identity.num_workers

    @property
    def worker_index(self) -> int:
        """This process's index among the workers (0 on the chief and single-process runs).

        Taken from the strategy's cluster resolver (task type and id), whichever it is:
        TF_CONFIG, Slurm, or another.
        """
        return self._identity.worker_index

    @property
    def is_chief(self) -> bool:
        """True on the one process that writes summaries, metrics and checkpoints."""
        return self._identity.is_chief

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Variables (models, optimizers, metrics) created here are replicated.

        Non-trainable floating-point variables that Keras leaves unaggregated, such as
        `keras.layers.BatchNormalization`'s moving mean and variance, are kept as one
        copy: each replica updates its own during a step, and `run` ends the step with
        one all-reduce that averages the updates over the replicas (statistics.py).
        """
        if self.mesh_target is not None:  # the mesh is current: mesh layers create DTensor variables
            with self.mesh_target.scope():
                yield
            return
        with self.strategy.scope():
            if self.strategy.num_replicas_in_sync > 1 and self.coordinator is None:
                with tf.variable_creator_scope(self._statistics.creator):
                    yield
            else:  # one copy already: one replica, or variables on parameter servers
                yield

    # -- speed: precision and XLA --------------------------------------------------

    def fastest_precision(self, make_timer=None, directory: Optional[str] = None) -> str:
        """The Keras precision policy that `run_experiment.precision = 'auto'` means here:
        measured once per machine (expframe/replicator/auto_settings.py), the same on
        every worker (the most conservative of the workers' choices)."""
        choice = auto_settings.auto_precision(self.target, make_timer=make_timer, directory=directory)
        if self.num_workers > 1:
            choice = auto_settings.agreed_precision(choice, self.num_workers, self.agree)
        return choice

    @property
    def compiles_steps(self) -> bool:
        """Whether `run_steps` compiles the step with XLA (`jit_compile`; 'auto' is decided
        on first use, under the precision policy in force then)."""
        return self._xla.compiles

    def exclude_from_xla(self, step_fn: Callable[..., Any], reason: str) -> None:
        """Marks a step that XLA cannot compile (it calls the host, say): `run_steps` never
        compiles it, and with `jit_compile=True` this is a ConfigError naming `reason`."""
        self._xla.exclude(step_fn, reason)

    # -- data ------------------------------------------------------------------------

    def check_global_batch(self, global_batch_size: int, binding: str = "Trainer.global_batch_size") -> int:
        """Returns the per-replica batch size; ConfigError unless it divides evenly."""
        if not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError(f"{binding}={global_batch_size!r} must be a positive integer.")
        if global_batch_size % self.num_replicas:
            lower = global_batch_size - global_batch_size % self.num_replicas
            raise ConfigError(
                f"{binding}={global_batch_size} is not divisible by the {self.num_replicas} "
                f"replicas of target '{self.target}'; use a multiple of {self.num_replicas} "
                f"(e.g. {lower or self.num_replicas} or {lower + self.num_replicas}).")
        return global_batch_size // self.num_replicas

    def distribute(self, input_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
                   global_batch_size: Optional[int] = None, service=None) -> DistributedInput:
        """Per-replica batches from `input_fn(ctx)` (ctx: `tf.distribute.InputContext`).

        `input_fn` builds this worker's pipeline and batches with
        `ctx.get_per_replica_batch_size(global_batch_size)`. Iterating the result gives
        a checkpointable iterator whose `next()` yields per-replica values. `service`:
        a `data_service.DataService` whose shards prepare the input (in its own order).
        """
        if global_batch_size is not None:
            self.check_global_batch(global_batch_size)
        if self.coordinator is not None:
            raise ConfigError(
                "Replicator.distribute is for synchronous targets; with 'parameter_server' "
                "use Replicator.per_worker_iterator(input_fn).")
        if self.mesh_target is not None:
            if service is not None:
                raise ConfigError("Trainer.data_service is for the 'cpu', 'gpu', 'tpu' and 'multi_worker' targets, "
                                  "not 'mesh'; unset it.")
            return self.mesh_target.distribute(input_fn, self.num_workers, self.worker_index)
        return DistributedInput(self.strategy, input_fn, self.num_workers, self.worker_index, service)

    def next_from(self, iterator) -> Any:
        """The next per-replica batch from `DistributedInput.plain_iterator()`; use inside
        a tf.function that takes the plain iterator as its argument."""
        if self.mesh_target is not None:  # the batch step_input fetched; run() lays it out on the mesh
            return iterator
        return per_replica(self.strategy, next(iterator), self.num_replicas // self.num_workers)

    def step_input(self, iterator):
        """What a tf.function that calls `next_from` takes: the plain iterator itself, or on
        the 'mesh' target the next batch, read on the host (a DTensor program cannot read
        a tf.data iterator)."""
        return self.mesh_target.shard(next(iterator)) if self.mesh_target is not None else iterator

    def per_worker_iterator(self, input_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]):
        """parameter_server only: per-worker iterators for `schedule_steps` (not checkpointable).

        `input_fn` gets an InputContext whose input_pipeline_id is the worker index.
        """
        return iter(self.coordinator.create_per_worker_dataset(
            lambda: self.strategy.distribute_datasets_from_function(input_fn)))

    # -- compute ---------------------------------------------------------------------

    def run(self, step_fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Runs `step_fn` on every replica; returns per-replica values.

        With 'parameter_server' it schedules the step on a free worker and returns a
        `RemoteValue`; call `join()` before reading it.
        """
        if self.coordinator is not None:
            return self.coordinator.schedule(step_fn, args=args, kwargs=kwargs)
        if self.mesh_target is not None:
            return self.mesh_target.run(step_fn, *args, **kwargs)
        return self.strategy.run(self._statistics.step(step_fn), args=args, kwargs=kwargs)

    def reduce(self, values: Any, op: str = "mean") -> Any:
        """Reduces per-replica values (a nested structure) to one value each, in cross-replica context.

        Scalars reduce over replicas; for tensors with a batch axis, reduce inside the
        step first (e.g. a per-replica mean).
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"Replicator.reduce op={op!r}: use one of {', '.join(_REDUCE_OPS)}.")
        if self.mesh_target is not None:  # one SPMD program: its values are already global
            return self.mesh_target.reduce(values)
        if op in ("sum", "mean"):
            reduce_op = tf.distribute.ReduceOp.SUM if op == "sum" else tf.distribute.ReduceOp.MEAN
            return tf.nest.map_structure(lambda v: self.strategy.reduce(reduce_op, v, axis=None), values)
        fn = tf.reduce_max if op == "max" else tf.reduce_min

        def reduce_one(v):
            gathered = self.strategy.gather(
                self.strategy.run(lambda t: tf.reshape(t, [1, -1]), args=(v,)), axis=0)
            return tf.reshape(fn(gathered, axis=0), tf.shape(self.local_results(v)[0]))
        return tf.nest.map_structure(reduce_one, values)

    def agree(self, value: float, op: str = "max") -> float:
        """The same Python number on every worker: `op` over all workers' `value`.

        Used by the host loop so that every worker stops (preemption) or evaluates
        for the same number of steps; free with one worker.
        """
        if self.num_workers == 1 or self.coordinator is not None:
            return value  # one host loop decides alone
        if not hasattr(self, "_agree_fn"):
            self._agree_fn = tf.function(lambda v, fn: self.strategy.run(fn, args=(v,)))
        fn = _AGREE_FNS[op]
        return float(self.local_results(self._agree_fn(tf.constant(float(value)), fn))[0])

    def run_steps(self, step_fn: Callable[..., Any], iterator, num_steps: int) -> Dict[str, float]:
        """Runs `num_steps` steps of `step_fn(next(iterator))` on every target, and waits.

        The one way to run many steps, whatever the target. Synchronous targets: one
        tf.function call in which the replicas loop over the steps (`iterator` from
        `iter(Replicator.distribute(...))`). 'parameter_server': the steps are spread
        over the workers, each running its share in one call (`iterator` from
        `per_worker_iterator`).

        Args:
          step_fn: a step that returns a dict of per-replica scalars.
          iterator: the input, as above.
          num_steps: steps to run (>= 1).

        Returns:
          The step's outputs as Python floats, averaged over replicas and steps.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"Replicator.run_steps num_steps={num_steps!r} must be a positive integer.")
        if self.coordinator is not None:
            workers = self.num_workers
            shares = [num_steps // workers + (1 if i < num_steps % workers else 0) for i in range(workers)]
            remote = [(n, self.schedule_steps(step_fn, iterator, n)) for n in shares if n]
            self.join()
            fetched = [(n, self.fetch(r)) for n, r in remote]
            return {k: sum(n * float(m[k]) for n, m in fetched) / num_steps for k in fetched[0][1]}
        if self.mesh_target is not None:
            return self.mesh_target.run_steps(step_fn, iterator, num_steps)
        loop = self._step_loop(step_fn, iterator, self._one_step_form(step_fn, num_steps))
        return {k: float(v) for k, v in self._xla.call(loop, iterator, tf.constant(num_steps, tf.int32)).items()}

    def _one_step_form(self, step_fn: Callable[..., Any], num_steps: Optional[int]) -> bool:
        """Whether a host call of `num_steps` runs the one-step form of the host call (no
        step loop in the graph): for one step, unless the looped form is traced already
        (it runs one step as well, and a second trace would cost the start-up again).

        The `tf.range` loop costs a fixed time per call even when it runs no iteration
        (issue 61, benchmarks/fit_gap.py's xf_step_loop: about 0.6 ms, 5 % of a ResNet-8
        call at 32 px on 2 CPU replicas; within noise at ResNet-50). Keras fit too runs a
        one-step execution without a loop."""
        return num_steps == 1 and step_fn not in getattr(self, "_step_loops", {})

    def _step_loop(self, step_fn: Callable[..., Any], iterator, one_step: bool = False):
        """The tf.function of `run_steps` on synchronous targets, one per step_fn and form:
        the replicated host loop around the step (or, `one_step`, the step alone),
        compiled with XLA per `jit_compile` (under 'auto' traced first with `iterator`,
        see xla_steps.py). Either form takes (iterator, steps)."""
        loops = self.__dict__.setdefault("_one_steps" if one_step else "_step_loops", {})
        loop = loops.get(step_fn)
        if loop is None:
            def build(replica_step):
                def step(it):
                    return self.reduce(self.run(replica_step, next(it)), "mean")

                def host_call(it, n):
                    if one_step:
                        del n  # always 1 (run_steps)
                        return step(it)
                    return mean_over_steps(lambda: step(it), n)
                return tf.function(host_call)
            loop = loops[step_fn] = self._xla.host_loop(build, step_fn, iterator, tf.TensorSpec([], tf.int32))
        return loop

    def check_variables(self, trackables: Dict[str, Any], owner: str) -> None:
        """After the task is built: refuses variables this target cannot run correctly
        (on 'mesh': plain Keras variables when the mesh has several devices)."""
        if self.mesh_target is not None:
            self.mesh_target.check_variables(trackables, owner)

    def trace_steps(self, step_fn: Callable[..., Any], iterator, num_steps: Optional[int] = None) -> None:
        """Traces what `run_steps(step_fn, iterator, num_steps)` runs, without running it or
        reading data; the next `run_steps` reuses the trace. Errors that tracing finds (a
        ConfigError of the step, e.g. gradients of an unscaled loss) surface here.
        `num_steps`: the usual host call's steps; 1 traces the one-step form (no step
        loop in the graph), anything else (or None) the looped form, which runs any
        number of steps, so no later call traces again.

        Synchronous tf.distribute targets only: on 'parameter_server' and 'mesh' the
        step is traced by its first `run_steps` (it needs a worker or a batch).
        """
        if self.coordinator is None and self.mesh_target is None:
            self._step_loop(step_fn, iterator, self._one_step_form(step_fn, num_steps)).get_concrete_function(
                iterator, tf.TensorSpec([], tf.int32))

    def schedule_steps(self, step_fn: Callable[..., Any], per_worker_iterator, num_steps: int) -> Any:
        """parameter_server: schedules `num_steps` steps of `step_fn(next(iterator))` on a free worker.

        Returns a RemoteValue of the step outputs averaged over the steps.
        """
        if not hasattr(self, "_worker_loops"):
            self._worker_loops = {}
        loop = self._worker_loops.get(step_fn)
        if loop is None:
            replica_step = self._xla.replica_step(step_fn)

            def worker_loop(iterator, n):
                return mean_over_steps(lambda: self.strategy.run(replica_step, args=(next(iterator),)), n)
            loop = self._worker_loops[step_fn] = tf.function(worker_loop)
        return self.coordinator.schedule(loop, args=(per_worker_iterator, tf.constant(num_steps, tf.int32)))

    def fetch(self, remote_value: Any) -> Any:
        """parameter_server: the value of a RemoteValue (waits for it)."""
        return tf.nest.map_structure(lambda v: v.fetch(), remote_value)

    def local_results(self, value: Any) -> tuple:
        """The values held by this process's replicas, as a tuple."""
        if self.mesh_target is not None:
            return (value,)
        return self.strategy.experimental_local_results(value)

    def join(self) -> None:
        """parameter_server: waits for all scheduled steps. No-op otherwise."""
        if self.coordinator is not None:
            self.coordinator.join()
