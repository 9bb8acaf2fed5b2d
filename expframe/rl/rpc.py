"""The learner's RPC service for actor processes: weights out, transitions in.

Transport is TensorFlow's gRPC RPC (`tf.distribute.experimental.rpc`): the learner
runs a `Server` with two methods, each a `tf.function` whose body hands its tensors
to Python on the learner's host (`tf.numpy_function`):

  weights(actor_id, sender)    -> (version, *policy weights)   the latest published policy
  insert(actor_id, sender, version, observation, action, reward, discount, next_observation,
         episode_returns, state) -> accepted (0 or 1)
  weight_names()               -> the names of the weights, in the order they are sent
  start_state(actor_id, sender) -> (lockstep 0 or 1, the state the actor starts from or b"")

One sender per actor id: `sender` is a number each `ActorClient` draws (its pid in the
high bits), and the first sender of an id owns it while it keeps calling. A second sender
under a live id (two actors started with one `--actor_id`) would interleave its steps
with the first one's in one stream of the learner's replay; it is refused (-2 from both
methods, which `ActorClient` turns into `DuplicateActorError`) and the learner logs one
line. An id whose sender has been silent `sender_timeout_s`, or that the learner
`release`d (its actor exited), goes to the next sender.

Weights by name: the learner gives the names of the weights it sends (`names`, e.g.
`expframe.rl.actors.weight_names(encoder, policy)`), and an actor compares them with its
own model's before it loads any (`ActorClient.check_names`): several kernels of one shape
(a pixel encoder's) would otherwise load in a wrong order without an error.

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

Lockstep (`lockstep=K` actors, `expframe.rl.lockstep`): the learner assigns each round of
chunks a weights version when it publishes (`publish(..., rounds=R)`); `weights` answers an
actor with its next chunk's version, or `WAIT` (the client retries) while that round has
none; inserts are kept per (round, actor) and the learner takes whole rounds in order
(`take_rounds`). Capacity, the `allow` limit and `max_lag` do not apply: the rounds are the
flow control. Lockstep actors send their state with each chunk (`insert`'s `state`, .npz
bytes; b"" otherwise) and ask `start_state` when they start: a restarted actor, and every
actor of a learner resumed from a checkpoint (`lockstep_state`), continues from the state
the lockstep bookkeeping holds for it.
"""

import collections
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from expframe.rl.lockstep import Chunk, Lockstep

FIELDS = ("observation", "action", "reward", "discount", "next_observation")
MAX_HELD_INSERTS = 8   # inserts held at once waiting for room; D4PGTask.host_threads reserves their threads
DUPLICATE = -2         # what both methods answer a second live sender of an actor id
STALE = -3             # what insert answers a chunk acted with weights older than `max_lag` learner steps
WAIT = -4              # what weights answers (lockstep) while the actor's next round has no version yet


class DuplicateActorError(RuntimeError):
    """The learner refuses this actor: another live actor sends under its actor id."""


class WeightNamesError(RuntimeError):
    """The learner's weights are not the ones this actor's model has, in its order."""


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
      names: the weights' names, in order (None: actors cannot check them).
      sender_timeout_s: how long an actor id stays with a sender that stopped calling.
      version: the version of `weights` (the learner step they are from, for lags in steps).
      lockstep: 0 (actors free-running), or the number of actors acting in lockstep with
        the learner (module docstring).
      lockstep_state: a checkpoint's `Lockstep.snapshot()` to continue from (None: fresh).
    """

    def __init__(self, weights: Sequence[np.ndarray], shapes: Dict[str, Tuple[int, ...]], capacity: int,
                 address: str = "127.0.0.1:0", insert_wait_s: float = 0.05, names: Optional[Sequence[str]] = None,
                 sender_timeout_s: float = 120.0, version: int = 0, lockstep: int = 0,
                 lockstep_state: Optional[Dict[str, np.ndarray]] = None):
        host, port = address.rsplit(":", 1)
        port = int(port) or free_port(host if host not in ("0.0.0.0", "") else "127.0.0.1")
        self.address = f"{host}:{port}"
        self.capacity = int(capacity)
        self.insert_wait_s = float(insert_wait_s)
        self._held = 0
        self._lock = threading.Condition()
        self._weights = [np.array(w) for w in weights]
        self.version = int(version)
        self._pending: List[Dict[str, np.ndarray]] = []
        self._pending_count = 0
        self.inserted = 0
        self._limit = None            # None: no samples-per-insert limit
        self.refused = 0
        self.max_version_lag = 0
        self.max_lag: Optional[int] = None   # refuse chunks acted with weights older than this (None: any)
        self.lags: collections.Counter = collections.Counter()   # lag -> transitions inserted at that lag
        self.stale = 0   # chunks refused as stale
        self.versions_used: Dict[int, int] = {}   # actor id -> version of its last insert
        self.episode_returns: List[float] = []
        self.closed = False
        self.lockstep = Lockstep(lockstep) if lockstep else None
        if self.lockstep is not None and lockstep_state:
            self.lockstep.restore(lockstep_state)
        self.names = None if names is None else [str(n) for n in names]
        if self.names is not None and len(self.names) != len(self._weights):
            raise ValueError(f"LearnerService: {len(self.names)} names for {len(self._weights)} weights.")
        self.sender_timeout_s = float(sender_timeout_s)
        self.senders: Dict[int, Tuple[int, float]] = {}   # actor id -> (sender, when it last called)
        self.first_seen: Dict[int, float] = {}   # actor id -> when its current sender first called (monotonic)
        self.duplicates_refused = 0
        self._refused_senders = set()
        self._server = tf.distribute.experimental.rpc.Server.create("grpc", self.address)
        weight_specs = [tf.TensorSpec(w.shape, tf.as_dtype(w.dtype)) for w in self._weights]

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64)])
        def weights_fn(actor_id, sender):
            out = tf.numpy_function(self._get_weights, [actor_id, sender],
                                    [tf.int64] + [s.dtype for s in weight_specs], stateful=True)
            out[0].set_shape([])
            for tensor, spec in zip(out[1:], weight_specs, strict=True):
                tensor.set_shape(spec.shape)
            return tuple(out)

        self.fields = tuple(shapes)
        field_specs = [tf.TensorSpec((None,) + shape, dtype) for shape, dtype in map(_spec, shapes.values())]

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64)] * 3 + field_specs
                     + [tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.string)])
        def insert_fn(actor_id, sender, version, *arrays):
            accepted = tf.numpy_function(self._insert, [actor_id, sender, version, *arrays], tf.int64, stateful=True)
            accepted.set_shape([])
            return accepted

        names_tensor = tf.constant(self.names or [], tf.string, shape=[len(self.names or [])])

        @tf.function(input_signature=[])
        def names_fn():
            return names_tensor

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64)])
        def start_state_fn(actor_id, sender):
            flag, state = tf.numpy_function(self._start_state, [actor_id, sender], [tf.int64, tf.string],
                                            stateful=True)
            flag.set_shape([])
            state.set_shape([])
            return flag, state

        self._server.register("weights", weights_fn)
        self._server.register("start_state", start_state_fn)
        self._server.register("insert", insert_fn)
        self._server.register("weight_names", names_fn)
        self._server.start()

    # -- learner side ------------------------------------------------------------------

    def publish(self, weights: Sequence[np.ndarray], step: Optional[int] = None, rounds: int = 0) -> int:
        """New policy weights for actors; returns their version: the learner step they are
        from when `step` is given (so lags count learner steps), else the next number. In
        lockstep, the rounds below `rounds` that have no version yet act with these."""
        copied = [np.array(w) for w in weights]
        with self._lock:
            self._weights = copied
            self.version = self.version + 1 if step is None else max(int(step), self.version)
            if self.lockstep is not None:
                self.lockstep.assign(rounds, self.version, copied)
            self._lock.notify_all()
            return self.version

    def take_rounds(self, upto: int, step: int) -> List[Chunk]:
        """(Lockstep) the chunks of the complete rounds below `upto` not taken yet, in order
        (module docstring), removed; their lags are counted as `step` minus the version
        each acted with (the learner step that takes them), so they do not depend on timing."""
        with self._lock:
            chunks = self.lockstep.take(upto)
            self._pending_count = self.lockstep.rows
            for actor_id, fields, returns, version in chunks:
                lag = int(step) - version
                self.lags[lag] += len(next(iter(fields.values())))
                self.max_version_lag = max(self.max_version_lag, lag)
                self.episode_returns.extend(returns)
                self.versions_used[actor_id] = version
            self._lock.notify_all()
        return chunks

    def wait_for_rounds(self, count: int, timeout: float) -> bool:
        """(Lockstep) waits until the first `count` rounds are complete or `timeout` s pass."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.lockstep.complete() < count and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return self.lockstep.complete() >= count

    def take_lags(self) -> Dict[int, int]:
        """How many transitions were inserted at each weight lag (versions behind the newest
        published when they arrived; learner steps when `publish` is given steps), since the
        last call."""
        with self._lock:
            out, self.lags = dict(self.lags), collections.Counter()
        return out

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

    def release(self, actor_id: int) -> None:
        """Actor `actor_id` has exited: its id goes to the next sender (its restart)."""
        with self._lock:
            self.senders.pop(int(actor_id), None)

    def close(self) -> None:
        """Refuses every later insert and fetch (the gRPC server lives until the process ends)."""
        with self._lock:
            self.closed = True
            self._lock.notify_all()

    # -- RPC bodies (host side) --------------------------------------------------------

    def _admit(self, actor_id: int, sender: int) -> bool:
        """Whether `sender` may call as `actor_id` (lock held): the id is free, its sender's
        own, or its sender has been silent `sender_timeout_s`. Logs a refused sender once."""
        now = time.monotonic()
        owner = self.senders.get(actor_id)
        if owner is None or owner[0] == sender or now - owner[1] > self.sender_timeout_s:
            if owner is None or owner[0] != sender:
                self.first_seen[actor_id] = now   # this sender's first call: it is ready
            self.senders[actor_id] = (sender, now)
            return True
        self.duplicates_refused += 1
        if sender not in self._refused_senders:
            self._refused_senders.add(sender)
            print(f"LearnerService: refused a second actor sending as actor id {actor_id} (pid {sender >> 32}); "
                  f"actor id {actor_id} is taken by pid {owner[0] >> 32} (its steps would interleave in one "
                  f"replay stream): give each actor its own --actor_id", file=sys.stderr, flush=True)
        return False

    def _start_state(self, actor_id, sender):
        with self._lock:
            if self.lockstep is None or self.closed:
                return np.int64(0 if self.lockstep is None else 1), np.bytes_(b"")
            if not self._admit(int(actor_id), int(sender)):
                return np.int64(DUPLICATE), np.bytes_(b"")
            return np.int64(1), np.bytes_(self.lockstep.start_state(int(actor_id)))

    def _get_weights(self, actor_id, sender):
        with self._lock:
            if not self.closed and not self._admit(int(actor_id), int(sender)):
                return [np.int64(DUPLICATE)] + self._weights
            if self.lockstep is None or self.closed:
                return [np.int64(-1 if self.closed else self.version)] + self._weights
            # Held a little for the learner to assign this actor's round, then WAIT (retry).
            deadline = time.monotonic() + self.insert_wait_s
            found = self.lockstep.fetch(int(actor_id))
            while found is None and not self.closed and time.monotonic() < deadline:
                self._lock.wait(max(deadline - time.monotonic(), 0.0))
                found = self.lockstep.fetch(int(actor_id))
            if self.closed:
                return [np.int64(-1)] + self._weights
            if found is None:
                return [np.int64(WAIT)] + self._weights
            return [np.int64(found[0])] + found[1]

    def _fits(self, count: int) -> bool:
        """Whether `count` more transitions fit both bounds: pending transitions under
        `capacity`, the inserted total under the learner's `allow` limit (lock held)."""
        return self._pending_count + count <= self.capacity and (
            self._limit is None or self.inserted + count <= self._limit)

    def _insert(self, actor_id, sender, version, *arrays):
        arrays, returns, state = arrays[:-2], arrays[-2], arrays[-1]
        count = len(arrays[0])
        deadline = time.monotonic() + self.insert_wait_s
        with self._lock:
            if not self.closed and not self._admit(int(actor_id), int(sender)):
                return np.int64(DUPLICATE)
            if self.lockstep is not None:
                return self._insert_round(int(actor_id), int(version), arrays, returns, bytes(state))
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
            lag = self.version - int(version)
            if not self.closed and self.max_lag is not None and lag > self.max_lag:
                # Acted with weights the learner has moved max_lag steps past: dropped; the
                # actor fetches the newest weights and acts again.
                self.stale += 1
                return np.int64(STALE)
            if self.closed or not self._fits(count):
                self.refused += 1
                return np.int64(-1 if self.closed else 0)
            self._pending.append((int(actor_id), dict(zip(self.fields, arrays, strict=True))))
            self._pending_count += count
            self.inserted += count
            self.episode_returns.extend(float(r) for r in returns)
            self.versions_used[int(actor_id)] = int(version)
            self.max_version_lag = max(self.max_version_lag, lag)
            self.lags[lag] += count
            self._lock.notify_all()
            return np.int64(1)


    def _insert_round(self, actor_id: int, version: int, arrays, returns, state: bytes) -> np.int64:
        """(Lockstep, lock held) keeps the chunk, and the actor's state after it, for its
        round; the learner takes it in order."""
        if self.closed:
            return np.int64(-1)
        fields = dict(zip(self.fields, arrays, strict=True))
        if not self.lockstep.add(actor_id, fields, [float(r) for r in returns], version, state):
            self.refused += 1
            return np.int64(0)
        self.inserted += len(arrays[0])
        self._pending_count = self.lockstep.rows
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
        self.address = address
        # Who is sending: this process's pid in the high bits, 32 random bits below.
        self.sender = (os.getpid() << 32) | int.from_bytes(os.urandom(4), "big")
        self._client = tf.distribute.experimental.rpc.Client.create(
            "grpc", address, name=f"actor_{actor_id}", timeout_in_ms=int(timeout_s * 1000))

    def _refused(self) -> DuplicateActorError:
        return DuplicateActorError(
            f"actor {self.actor_id}: the learner at {self.address} refuses this actor: another live actor sends as "
            f"actor id {self.actor_id}; give each actor its own --actor_id")

    def _ids(self) -> List[tf.Tensor]:
        return [tf.constant(self.actor_id, tf.int64), tf.constant(self.sender, tf.int64)]

    def weights(self) -> Tuple[int, List[np.ndarray]]:
        """(version, weights); version -1 means the learner has closed. In lockstep, the
        weights of this actor's next round, asked again while the learner has not assigned it.

        Raises:
          DuplicateActorError: another live actor sends under this actor id.
        """
        while True:
            out = self._client.weights(*self._ids()).get_value()
            if int(out[0]) == DUPLICATE:
                raise self._refused()
            if int(out[0]) != WAIT:
                return int(out[0]), [np.asarray(w) for w in out[1:]]
            time.sleep(0.01)

    def weight_names(self) -> List[str]:
        """The names the learner gives its weights, in the order it sends them ([]: none given)."""
        out = self._client.weight_names().get_value()
        return [n.decode() for n in np.asarray(out).reshape(-1).tolist()]

    def check_names(self, names: Sequence[str]) -> None:
        """Raises `WeightNamesError` unless the learner's weights are `names`, in that order
        (a learner that gives no names is not checked)."""
        theirs = self.weight_names()
        if not theirs or list(theirs) == list(names):
            return
        if len(theirs) != len(names):
            what = f"the learner sends {len(theirs)} weights, this actor's policy has {len(names)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(theirs, names, strict=True)) if a != b)
            what = f"weight {i} is the learner's {theirs[i]!r} but this actor's {names[i]!r}"
        raise WeightNamesError(f"actor {self.actor_id}: the learner's weights do not match this actor's policy "
                               f"({what}); the learner and the actor must build the same acting policy "
                               "(same gin config and expframe version).")

    def start_state(self) -> Tuple[bool, bytes]:
        """(Whether the learner runs its actors in lockstep, the state this actor starts from:
        b"" for its own fresh one.)

        Raises:
          DuplicateActorError: another live actor sends under this actor id.
        """
        flag, state = self._client.start_state(*self._ids()).get_value()
        if int(flag) == DUPLICATE:
            raise self._refused()
        return bool(int(flag)), bytes(state.numpy())

    def insert(self, version: int, transitions: Dict[str, np.ndarray], returns: Sequence[float],
               state: bytes = b"") -> int:
        """Sends transitions (the service's fields, in its order, with their dtypes), and in
        lockstep the actor's state after them; 1 accepted, 0 refused (retry later), -1 the
        learner has closed, `STALE` acted with weights older than the learner's `max_lag`
        (dropped: fetch and act again)."""
        args = self._ids() + [tf.constant(version, tf.int64)]
        args += [tf.constant(np.asarray(array)) for array in transitions.values()]
        args.append(tf.constant(np.asarray(returns, np.float32).reshape(-1)))
        args.append(tf.constant(state, tf.string))
        accepted = int(self._client.insert(*args).get_value())
        if accepted == DUPLICATE:
            raise self._refused()
        return accepted
