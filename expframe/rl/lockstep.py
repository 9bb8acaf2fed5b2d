"""Lockstep acting: which weights each actor chunk acts with, and which chunks each learner
step takes, fixed by counts instead of timing (`run_experiment.deterministic = True` with
`D4PGTask.num_actors > 0`).

Free-running actors (the default) act with whichever weights were published last, and the
learner takes whatever transitions have arrived: two runs differ as soon as one actor is a
little faster. In lockstep the actors' chunks (`weights_every` environment steps each) are
numbered per actor: 0, 1, 2, ... A **round** is chunk r of every actor. Then:

* the learner gives each round a weights version when it publishes: publishing at learner
  step s assigns version s to every round that the next host call but one will need
  (`rounds` given to `assign`), so actors act one host call ahead of the learner, as the
  free-running ones may;
* an actor asks for its next chunk's weights and gets those of its round's version, or waits
  until the learner has assigned that round;
* the learner takes whole rounds, in round order and actor order within a round, and no
  others: the replay receives the same rows in the same order in every run.

What one run then depends on is the run's seed and the counts, not on which process ran
first.

Actors send their state (`SynchronousActor.state()`: noise generator, episode in progress,
adder, environment physics; as .npz bytes) with each chunk, as it is after the chunk. So:

* a restarted actor starts from the state after its last chunk received (`start_state`)
  and acts its next round as the actor it replaces would have;
* a checkpoint holds `snapshot()`: the rounds taken, the versions and weights of rounds
  given out and not taken, and each actor's state after the last round taken. A learner
  resumed from it (`restore`) gives its actors those states, and the rounds they had acted
  ahead are acted again, the same way: the resumed run continues as if never stopped.

This object is plain bookkeeping, called with `LearnerService`'s lock held.
"""

import collections
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

Chunk = Tuple[int, Dict[str, np.ndarray], List[float], int]   # (actor id, fields, episode returns, version)
SNAPSHOT = "lockstep/"   # the prefix of `snapshot()`'s arrays


class Lockstep:
    """Round bookkeeping for `num_actors` actors (see module docstring).

    Example:
      lock = Lockstep(2)
      lock.assign(3, version=0, weights=w0)   # rounds 0-2 act with the weights of step 0
      lock.fetch(1)                           # (0, w0): actor 1's chunk 0 is in round 0
      lock.add(1, fields, returns, 0)         # actor 1's chunk 0 arrived
      lock.take(1)                            # round 0, once actor 0's chunk 0 is there too
    """

    def __init__(self, num_actors: int):
        if num_actors < 1:
            raise ValueError(f"Lockstep: num_actors={num_actors} must be at least 1.")
        self.num_actors = int(num_actors)
        self.assigned = 0                            # rounds that have a weights version
        self.taken = 0                               # rounds handed to the learner
        self.versions: Dict[int, int] = {}           # round -> version it acts with
        self.weights: Dict[int, List[np.ndarray]] = {}   # version -> weights, while a round needs them
        self.sent: collections.Counter = collections.Counter()   # actor id -> chunks received
        self.chunks: Dict[Tuple[int, int], Chunk] = {}   # (round, actor id) -> chunk, until taken
        self.states: Dict[Tuple[int, int], bytes] = {}   # (round, actor id) -> actor state after it, until taken
        self.last_state: Dict[int, bytes] = {}       # actor id -> its state after its last chunk received
        self.taken_state: Dict[int, bytes] = {}      # actor id -> its state after the last round taken
        self.rows = 0                                # rows received and not yet taken

    def assign(self, rounds: int, version: int, weights: Sequence[np.ndarray]) -> None:
        """Rounds up to `rounds` (exclusive) that have no version yet act with `weights`,
        the learner's weights of step `version`."""
        if rounds > self.assigned:
            self.weights[int(version)] = list(weights)
            for r in range(self.assigned, rounds):
                self.versions[r] = int(version)
            self.assigned = int(rounds)
        self._prune()

    def fetch(self, actor_id: int) -> Optional[Tuple[int, List[np.ndarray]]]:
        """(version, weights) for actor `actor_id`'s next chunk; None while its round has no
        version yet (the actor waits)."""
        r = self.sent[int(actor_id)]
        if r >= self.assigned:
            return None
        version = self.versions[r]
        return version, self.weights[version]

    def add(self, actor_id: int, fields: Dict[str, np.ndarray], returns: List[float], version: int,
            state: bytes = b"") -> bool:
        """Records actor `actor_id`'s next chunk, with the actor's state after it; False (not
        recorded) if its round has no version yet (an actor that sends without fetching first)."""
        actor_id = int(actor_id)
        r = self.sent[actor_id]
        if r >= self.assigned or actor_id >= self.num_actors:
            return False
        self.chunks[(r, actor_id)] = (actor_id, fields, list(returns), int(version))
        self.states[(r, actor_id)] = self.last_state[actor_id] = bytes(state)
        self.sent[actor_id] += 1
        self.rows += len(next(iter(fields.values())))
        return True

    def complete(self) -> int:
        """Rounds, counted from the first, whose every chunk has arrived (taken ones included)."""
        r = self.taken
        while r < self.assigned and all((r, a) in self.chunks for a in range(self.num_actors)):
            r += 1
        return r

    def take(self, upto: int) -> List[Chunk]:
        """The chunks of the complete rounds below `upto` not taken yet, round by round and by
        actor id within a round; they are removed."""
        out = []
        end = min(int(upto), self.complete())
        for r in range(self.taken, end):
            for a in range(self.num_actors):
                chunk = self.chunks.pop((r, a))
                self.taken_state[a] = self.states.pop((r, a))
                self.rows -= len(next(iter(chunk[1].values())))
                out.append(chunk)
        self.taken = max(self.taken, end)
        self._prune()
        return out

    def start_state(self, actor_id: int) -> bytes:
        """The state actor `actor_id` starts from (b"": its own, fresh): after its last chunk
        received (a restart), or after the last round taken (a resumed learner's actors)."""
        return self.last_state.get(int(actor_id), b"")

    def snapshot(self) -> Dict[str, np.ndarray]:
        """What a checkpoint holds to resume exactly (module docstring), as named arrays:
        `lockstep/taken`, `lockstep/assigned`, `lockstep/versions` ([round, version] rows of
        the rounds given out and not taken), `lockstep/weights/<version>/<i>` and
        `lockstep/state/<actor id>` (the state's bytes as uint8)."""
        out = {f"{SNAPSHOT}taken": np.array(self.taken, np.int64),
               f"{SNAPSHOT}assigned": np.array(self.assigned, np.int64),
               f"{SNAPSHOT}versions": np.array(sorted(self.versions.items()), np.int64).reshape(-1, 2)}
        for version, weights in self.weights.items():
            out.update({f"{SNAPSHOT}weights/{version}/{i}": np.asarray(w) for i, w in enumerate(weights)})
        for actor_id, state in self.taken_state.items():
            out[f"{SNAPSHOT}state/{actor_id}"] = np.frombuffer(state, np.uint8)
        return out

    def restore(self, arrays: Dict[str, np.ndarray]) -> None:
        """Continues from `snapshot()`: every actor at the first round not taken, starting
        from its state after the rounds taken; the rounds given out keep their versions."""
        self.taken = int(arrays[f"{SNAPSHOT}taken"])
        self.assigned = int(arrays[f"{SNAPSHOT}assigned"])
        self.versions = {int(r): int(v) for r, v in arrays[f"{SNAPSHOT}versions"]}
        weights: Dict[int, Dict[int, np.ndarray]] = collections.defaultdict(dict)
        for name, value in arrays.items():
            if name.startswith(f"{SNAPSHOT}weights/"):
                version, i = name[len(f"{SNAPSHOT}weights/"):].split("/")
                weights[int(version)][int(i)] = np.array(value)
        self.weights = {v: [w[i] for i in range(len(w))] for v, w in weights.items()}
        self.taken_state = {int(name[len(f"{SNAPSHOT}state/"):]): value.tobytes() for name, value in arrays.items()
                            if name.startswith(f"{SNAPSHOT}state/")}
        self.last_state = dict(self.taken_state)
        self.sent = collections.Counter({a: self.taken for a in range(self.num_actors)})
        self.chunks, self.states, self.rows = {}, {}, 0

    def _prune(self) -> None:
        """Forgets the versions of taken rounds, and weights no round left needs."""
        for r in [r for r in self.versions if r < self.taken]:
            del self.versions[r]
        needed = set(self.versions.values())
        for version in [v for v in self.weights if v not in needed]:
            del self.weights[version]
