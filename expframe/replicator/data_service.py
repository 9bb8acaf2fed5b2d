"""Train input prepared by TensorFlow's tf.data service, in the order of the input itself.

A host whose CPUs cannot keep its accelerators fed (the planner says so: `input` binds,
docs/planning.md) moves its preprocessing to other machines with one binding:

    Trainer.data_service = 'local:2'                       # 2 shards in this process (tests, trials)
    Trainer.data_service = 'node7:5050,node8:5050'         # shards started by hand or by Slurm
    python -m expframe.launch --data_service_workers=2 -- main.py ...  # shards beside a cluster

Design: K shards, each a tf.data service of one dispatcher and one worker, and each
trainer pipeline split over them by whole steps: shard k prepares the steps k, k + K,
k + 2K, ... of the pipeline's stream (`ctx.step_shard`, expframe/data/order.py: by index,
nothing computed twice), in `parallel_epochs` mode (ShardingPolicy.OFF: its one worker
runs the whole shard, in order), and the trainer takes one step from each shard in
turn (`Dataset.choose_from_datasets`). The stream the steps read is therefore the one
the pipeline gives without the service, element for element, so every contract of the
input holds unchanged: each epoch sees every example exactly once, a run repeats, and a
resume rebuilds the shards at the checkpointed position (`ctx.start_example`), neither
skipping nor repeating (the service's iterators cannot be checkpointed, and need not
be). Why not the service's own modes:

- `distributed_epoch` (dynamic sharding) hands splits to whichever worker asks: the
  order of the steps changes from run to run (measured: benchmarks/data_service_overhead.py),
  so no run repeats and a resume cannot know which examples were consumed; and it
  visits at most once (a restarted worker loses its split).
- one dispatcher with K workers and static sharding: each worker's shard is ordered,
  but the client reads the workers as their batches arrive, in no fixed order.

The cost of the design: a shard's worker is its only one (no load balancing between
shards; a slow shard paces the run), and an input_fn must be index-based and honour
`ctx.step_shard` (expframe's datasets do); any other is refused in one line.

Servers: `serve_shard` runs one shard (a dispatcher and its worker) until signalled,
as `python -m expframe.launch --serve_data_shard` does; `'local:K'` starts K in
this process (they share its CPUs: for tests and trials, not for speed).
"""

import os
import threading
import time
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from expframe.errors import ConfigError

#: The shards the launcher started (`--data_service_workers`), host:port,host:port.
SERVICE_ENV = "EXPFRAME_DATA_SERVICE"
_BINDING = "Trainer.data_service"
_service = tf.data.experimental.service
_local_shards: dict = {}  # K -> the in-process servers of 'local:K', kept for the process's life
_lock = threading.Lock()


def start_shard(port: int = 0, host: str = "localhost"):
    """(dispatcher, worker) of one shard on `host`; `port` 0 picks a free one. The worker
    advertises `host` to the clients."""
    # A job whose client went (a trainer restarted its input, or died) stops within about a
    # second: the worker hears of it at its next heartbeat (TensorFlow's default: 30 s, in
    # which it would go on preparing batches nobody reads), and a job whose client vanished
    # without a word (SIGKILL) is collected 10 s after the dispatcher gives the client up
    # (TensorFlow's client timeout, 5 min; the collection's default: 5 min more).
    dispatcher = _service.DispatchServer(_service.DispatcherConfig(
        port=port, protocol="grpc", job_gc_check_interval_ms=1_000, job_gc_timeout_ms=10_000))
    address = dispatcher.target.split("://", 1)[1]
    worker = _service.WorkerServer(_service.WorkerConfig(
        dispatcher_address=address, worker_address=f"{host}:%port%", port=0, protocol="grpc",
        heartbeat_interval_ms=500))
    return dispatcher, worker


def serve_shard(port: int, host: str, address_file: Optional[str] = None,
                announce: Callable[[str], None] = print) -> None:
    """Runs one shard on `host`:`port` (0: a free port) until the process is signalled
    (the launcher, Slurm); once it serves, writes host:port into `address_file` (atomically)."""
    dispatcher, _ = start_shard(port, host)
    address = f"{host}:{dispatcher.target.rsplit(':', 1)[1]}"
    if address_file:
        partial = f"{address_file}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(address + "\n")
        os.replace(partial, address_file)
    announce(f"data service shard serving at {address} (a dispatcher and its one worker)")
    while True:  # signals end it (their default action: the launcher and Slurm send SIGTERM)
        time.sleep(3600)


def _addresses(spec: str) -> List[str]:
    if spec.startswith("local:"):
        count = spec.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"{_BINDING}={spec!r}: 'local:K' takes a shard count K >= 1, e.g. 'local:2'.")
        with _lock:
            if int(count) not in _local_shards:
                _local_shards[int(count)] = [start_shard() for _ in range(int(count))]
            servers = _local_shards[int(count)]
        return [d.target.split("://", 1)[1] for d, _ in servers]
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{_BINDING}={spec!r}: {address!r} is not host:port; give the shards' dispatchers "
                              "as 'host:port,host:port', 'local:K' to start K here, or None.")
    if not addresses:
        raise ConfigError(f"{_BINDING}={spec!r} names no shard: give 'host:port,...', 'local:K' or None.")
    return addresses


class DataService:
    """The shards that prepare a trainer's train input (see the module docstring).

    Args:
      addresses: one dispatcher address per shard, host:port.
      origin: where they came from, for the start line.
    """

    def __init__(self, addresses: Sequence[str], origin: str):
        self.addresses = list(addresses)
        self.origin = origin

    @property
    def shards(self) -> int:
        return len(self.addresses)

    def describe(self) -> str:
        """One line for the run's start: where the train input is prepared."""
        return (f"train input: prepared by the tf.data service, {self.shards} shard(s) at "
                f"{','.join(self.addresses)} ({self.origin}); steps taken from each shard in turn, in the "
                "input's own order (exactly once per epoch; resume and repeat as without the service)")

    def check_input(self, index_based: bool, honours_shards: bool) -> None:
        """Refuses, in one line, an input_fn the shards cannot split by steps."""
        if not index_based:
            raise ConfigError(
                f"{_BINDING}: the train input_fn does not start at ctx.start_example (or its batches do not "
                "add up to the global batch), so the tf.data service's shards cannot prepare its steps by "
                "index; build it on expframe.data.order.positions (as expframe's datasets are), or unset "
                f"{_BINDING}.")
        if not honours_shards:
            raise ConfigError(
                f"{_BINDING}: the train input_fn reads ctx.start_example but not ctx.step_shard, so every shard "
                "would prepare the whole stream; take its positions from expframe.data.order.positions(ctx, "
                f"start) (or filter with order.in_step_shard), or unset {_BINDING}.")

    def serve(self, datasets: Sequence[tf.data.Dataset]) -> tf.data.Dataset:
        """The shards' datasets (shard k's steps) served by the shards, one step from each in turn."""
        served = [dataset.apply(_service.distribute(
            processing_mode=_service.ShardingPolicy.OFF, service=f"grpc://{address}"))
            for dataset, address in zip(datasets, self.addresses, strict=True)]
        if len(served) == 1:
            return served[0]
        order = tf.data.Dataset.range(len(served)).repeat()
        return tf.data.Dataset.choose_from_datasets(served, order)


def resolve(spec: Optional[str]) -> Optional[DataService]:
    """The DataService of `Trainer.data_service` (None: the launcher's, if it started one;
    'off': none), or None for in-process input."""
    if spec is None:
        spec = os.environ.get(SERVICE_ENV) or None
        origin = f"started by expframe.launch, ${SERVICE_ENV}"
        if spec is None:
            return None
    elif not isinstance(spec, str):
        raise ConfigError(f"{_BINDING}={spec!r} must be a string: 'host:port,...', 'local:K', 'off' or None.")
    else:
        if spec == "off":
            return None
        origin = f"{_BINDING}={spec!r}"
    return DataService(_addresses(spec), origin)
