"""The learner's RPC service for actor processes: weights out, transitions in.

Transport is TensorFlow's gRPC RPC (`tf.distribute.experimental.rpc`): the learner
runs a `Server` with two methods, each a `tf.function` whose body hands its tensors
to Python on the learner's host (`tf.numpy_function`):

  weights(actor_id)            -> (version, *policy weights)   the latest published policy
  insert(actor_id, version, observation, action, reward, discount, next_observation,
         episode_returns)      -> accepted (0 or 1)

The fields an insert carries are the service's `shapes` (by default `FIELDS`, whole
transitions of float32; pixel actors send `expframe.rl.frame_replay.STEP_FIELDS`, uint8
frames among them, each with its dtype).

`version` counts `publish` calls; an actor sends back the version it acted with, so
the learner can check how stale acting was (`max_version_lag`). An insert is refused
(the actor waits and retries) when it would take the pending transitions over
`capacity` (a fast actor cannot exhaust memory) or the inserted total over the limit
the learner sets with `allow` (the samples-per-insert ratio: actors wait for the
learner); such an insert is first held up to `insert_wait_s` in case room appears.
Bound to 127.0.0.1 by default; give `address='0.0.0.0:PORT'` (or a host's address)
to serve actors on other machines.
"""

import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

FIELDS = ("observation", "action", "reward", "discount", "next_observation")
MAX_HELD_INSERTS = 8   # inserts held at once waiting for room; the CPU target has 16 inter-op threads


def _spec(spec) -> Tuple[Tuple[int, ...], tf.DType]:
    """A field's (shape, dtype) from a shape (float32) or a (shape, dtype) pair."""
    if len(spec) == 2 and isinstance(spec[0], (tuple, list)):
        return tuple(spec[0]), tf.as_dtype(spec[1])
    return tuple(spec), tf.float32


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LearnerService:
    """Serves policy weights to actors and collects their transitions (module docstring).

    Example:
      service = LearnerService(policy.get_weights(), {"observation": (5,), ...}, capacity=100_000)
      service.publish(policy.get_weights())   # version 1
      service.allow(5_000)                    # actors may insert up to 5,000 in total
      batch = service.take()                  # pending transitions as arrays

    Args:
      weights: the policy's initial weights (shapes and dtypes fix the RPC signature).
      shapes: each field an insert carries, in order: name -> shape of one row (float32),
        or name -> (shape, dtype); e.g. one for each name in `FIELDS`.
      capacity: most transitions pending (inserted, not yet taken).
      address: host:port to bind; port 0 picks a free one.
      insert_wait_s: how long an insert that does not fit waits for room before it is
        refused (the actor then retries).
    """

    def __init__(self, weights: Sequence[np.ndarray], shapes: Dict[str, Tuple[int, ...]], capacity: int,
                 address: str = "127.0.0.1:0", insert_wait_s: float = 0.05):
        host, port = address.rsplit(":", 1)
        port = int(port) or free_port(host if host not in ("0.0.0.0", "") else "127.0.0.1")
        self.address = f"{host}:{port}"
        self.capacity = int(capacity)
        self.insert_wait_s = float(insert_wait_s)
        self._held = 0
        self._lock = threading.Condition()
        self._weights = [np.array(w) for w in weights]
        self.version = 0
        self._pending: List[Dict[str, np.ndarray]] = []
        self._pending_count = 0
        self.inserted = 0
        self._limit = None            # None: no samples-per-insert limit
        self.refused = 0
        self.max_version_lag = 0
        self.versions_used: Dict[int, int] = {}   # actor id -> version of its last insert
        self.episode_returns: List[float] = []
        self.closed = False
        self._server = tf.distribute.experimental.rpc.Server.create("grpc", self.address)
        weight_specs = [tf.TensorSpec(w.shape, tf.as_dtype(w.dtype)) for w in self._weights]

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
        def weights_fn(actor_id):
            out = tf.numpy_function(self._get_weights, [actor_id], [tf.int64] + [s.dtype for s in weight_specs],
                                    stateful=True)
            out[0].set_shape([])
            for tensor, spec in zip(out[1:], weight_specs, strict=True):
                tensor.set_shape(spec.shape)
            return tuple(out)

        self.fields = tuple(shapes)
        field_specs = [tf.TensorSpec((None,) + shape, dtype) for shape, dtype in map(_spec, shapes.values())]

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64)] + field_specs
                     + [tf.TensorSpec([None], tf.float32)])
        def insert_fn(actor_id, version, *arrays):
            accepted = tf.numpy_function(self._insert, [actor_id, version, *arrays], tf.int64, stateful=True)
            accepted.set_shape([])
            return accepted

        self._server.register("weights", weights_fn)
        self._server.register("insert", insert_fn)
        self._server.start()

    # -- learner side ------------------------------------------------------------------

    def publish(self, weights: Sequence[np.ndarray]) -> int:
        """New policy weights for actors; returns their version."""
        copied = [np.array(w) for w in weights]
        with self._lock:
            self._weights = copied
            self.version += 1
            return self.version

    def allow(self, limit: Optional[int]) -> None:
        """Actors may insert up to `limit` transitions in total (None: no limit)."""
        with self._lock:
            self._limit = limit
            self._lock.notify_all()

    def pending(self) -> int:
        with self._lock:
            return self._pending_count

    def wait_for(self, count: int, timeout: float) -> bool:
        """Waits until `count` transitions are pending or `timeout` s pass; True if reached."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending_count < count and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return self._pending_count >= count

    def take(self) -> Dict[str, np.ndarray]:
        """The pending transitions (arrays with a leading count axis), removed from the service."""
        with self._lock:
            pending, self._pending, self._pending_count = self._pending, [], 0
            self._lock.notify_all()
        if not pending:
            return {}
        return {f: np.concatenate([p[f] for _, p in pending]) for f in self.fields}

    def take_inserts(self) -> List[Tuple[int, Dict[str, np.ndarray]]]:
        """The pending inserts as (actor id, arrays), in the order they arrived, removed."""
        with self._lock:
            pending, self._pending, self._pending_count = self._pending, [], 0
            self._lock.notify_all()
        return pending

    def take_returns(self) -> List[float]:
        """Returns of the actors' episodes reported since the last call."""
        with self._lock:
            out, self.episode_returns = self.episode_returns, []
        return out

    def close(self) -> None:
        """Refuses every later insert and fetch (the gRPC server lives until the process ends)."""
        with self._lock:
            self.closed = True
            self._lock.notify_all()

    # -- RPC bodies (host side) --------------------------------------------------------

    def _get_weights(self, actor_id):
        with self._lock:
            return [np.int64(-1 if self.closed else self.version)] + self._weights

    def _fits(self, count: int) -> bool:
        """Whether `count` more transitions fit both bounds: pending transitions under
        `capacity`, the inserted total under the learner's `allow` limit (lock held)."""
        return self._pending_count + count <= self.capacity and (
            self._limit is None or self.inserted + count <= self._limit)

    def _insert(self, actor_id, version, *arrays):
        arrays, returns = arrays[:-1], arrays[-1]
        count = len(arrays[0])
        deadline = time.monotonic() + self.insert_wait_s
        with self._lock:
            # Held here (not refused at once) while the learner may still let it in: the
            # insert goes through the moment `allow` or `take` makes room, and the actor
            # does not poll (each poll is an RPC, CPU on both sides of a shared machine).
            # A held insert keeps one of the learner's TensorFlow inter-op threads, so at
            # most `MAX_HELD_INSERTS` are held at once; others are refused at once.
            held = False
            while not self.closed and not self._fits(count):
                left = deadline - time.monotonic()
                if left <= 0 or (not held and self._held >= MAX_HELD_INSERTS):
                    break
                if not held:
                    held, self._held = True, self._held + 1
                self._lock.wait(left)
            if held:
                self._held -= 1
            if self.closed or not self._fits(count):
                self.refused += 1
                return np.int64(-1 if self.closed else 0)
            self._pending.append((int(actor_id), dict(zip(self.fields, arrays, strict=True))))
            self._pending_count += count
            self.inserted += count
            self.episode_returns.extend(float(r) for r in returns)
            self.versions_used[int(actor_id)] = int(version)
            self.max_version_lag = max(self.max_version_lag, self.version - int(version))
            self._lock.notify_all()
            return np.int64(1)


class ActorClient:
    """An actor's side of `LearnerService`.

    Args:
      address: the service's host:port.
      actor_id: this actor's id (reported with every call).
      timeout_s: per call; a learner that does not answer raises `tf.errors` errors.
    """

    def __init__(self, address: str, actor_id: int, timeout_s: float = 30.0):
        self.actor_id = int(actor_id)
        self._client = tf.distribute.experimental.rpc.Client.create(
            "grpc", address, name=f"actor_{actor_id}", timeout_in_ms=int(timeout_s * 1000))

    def weights(self) -> Tuple[int, List[np.ndarray]]:
        """(version, weights); version -1 means the learner has closed."""
        out = self._client.weights(tf.constant(self.actor_id, tf.int64)).get_value()
        return int(out[0]), [np.asarray(w) for w in out[1:]]

    def insert(self, version: int, transitions: Dict[str, np.ndarray], returns: Sequence[float]) -> int:
        """Sends transitions (the service's fields, in its order, with their dtypes);
        1 accepted, 0 refused (retry later), -1 the learner has closed."""
        args = [tf.constant(self.actor_id, tf.int64), tf.constant(version, tf.int64)]
        args += [tf.constant(np.asarray(array)) for array in transitions.values()]
        args.append(tf.constant(np.asarray(returns, np.float32).reshape(-1)))
        return int(self._client.insert(*args).get_value())
