"""Prioritised replay of n-step transitions between stacked frames that stores each frame once.

A pixel observation is a stack of the last k frames (`expframe/rl/pixels.py`), so an
n-step transition (o_t, a_t, R_t, D_t, o_{t+n}) written out whole holds 2k frames, and
consecutive transitions hold the same frames again. Here every rendered frame is
written once, as uint8, into a ring of `capacity` rows; stacks and transitions are
rebuilt from it by index when sampled:

  row            one frame, with the global id of the episode's previous frame
                 (`prev`; a first frame points to itself), the id of its successor,
                 and, once complete, the transition that starts from it: action a_t,
                 n-step reward R_t and discount D_t, and the id of the frame of o_{t+m}.
  stack(g)       frames prev^{k-1}(g), ..., prev(g), g: the last k frames of the
                 episode up to g, the first frame repeated before the episode began
                 (what the environment's stack held).
  transition(g)  (stack(g), a, R, D, stack(next(g))), with R, D as `NStepAdder` computes
                 them: m = n steps, or fewer where the episode ends (the bootstrap from
                 its last observation discounted by gamma^m times the environment's
                 discounts; 0 after a terminal state).

Ids are global frame counts (frame g lives in row g % capacity), so the rows of
several actors' episodes can interleave in arrival order: each stream (one actor)
keeps its own current frame and window of pending steps. A transition is sampled only
while all 2k frames it reads are still in the ring: when frame x is overwritten, the
transitions of x and of its k - 1 successors are dropped (their stacks read x; any
transition whose next stack reads x starts at x or later, or before x and so was
overwritten first), and a transition completing after one of its frames was
overwritten is never added. Memory per transition is one frame plus ~70 bytes (and one
extra frame per episode, its last observation), against 2k frames written out whole.

With `random_shift = p` (gin: `FrameReplay.random_shift = 4`), sampled observations and
next observations are shifted by DrQ's random-shift augmentation (Kostrikov et al. 2020,
arXiv 2004.13649; github.com/denisyarats/drq replay_buffer.py): each stack is padded by p
pixels repeating its edges and cropped back at a uniformly random offset, drawn per
stack, the same for all k frames of one stack. The shifts come from the sampler's random
state, so they are reproducible and resume exactly.

Priorities are as in `PrioritizedReplay` (proportional, a sum tree, new transitions at
the largest priority seen, importance weights (N P(i))^-beta / max); N counts the
transitions that can be sampled.

    replay = FrameReplay(100_000, frame_shape=(64, 64, 3), action_size=1, frame_stack=3,
                         n_step=5, discount=0.99)
    replay.start(stream=0, frame=first_frame)
    replay.add(stream=0, action=a, reward=r, discount=d, next_frame=f, last=False)
    batch = replay.sample(256, beta=0.4)    # observation, next_observation uint8 [256, 64, 64, 9], ...
"""

import collections
import json
from typing import Dict, Hashable, Optional, Sequence

import gin
import numpy as np

from expframe.errors import ConfigError
from expframe.rl.sum_tree import SumTree

# One step of an actor's stream, as actor processes send them (`StepBuffer`).
STEP_FIELDS = ("frame", "action", "reward", "discount", "next_frame", "first", "last")


class _Stream:
    """One actor's episode in progress: its current frame and the steps not yet written."""

    def __init__(self):
        self.current = -1                    # id of the current observation's frame; -1: no episode
        self.window = collections.deque()    # (frame id, reward, environment discount) per pending step


def random_shift(stacks: np.ndarray, pad: int, rng: np.random.Generator) -> np.ndarray:
    """DrQ's augmentation: pad each [H, W, C] image by `pad` (edge pixels repeated), crop back
    at a random offset in [0, 2 pad] per image."""
    count, height, width = stacks.shape[:3]
    padded = np.pad(stacks, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
    offsets = rng.integers(0, 2 * pad + 1, size=(count, 2))
    rows = offsets[:, :1] + np.arange(height)[None]        # [count, H]
    cols = offsets[:, 1:] + np.arange(width)[None]         # [count, W]
    return padded[np.arange(count)[:, None, None], rows[:, :, None], cols[:, None, :]]


@gin.configurable(allowlist=["random_shift"])
class FrameReplay:
    """A bounded, prioritised replay of stacked-frame n-step transitions (module docstring).

    Args:
      capacity: frames kept (about one per transition); the oldest is overwritten.
      frame_shape: shape of one frame, e.g. (64, 64, 3) (stored as uint8).
      action_size: action dimensions.
      frame_stack: k, frames per observation.
      n_step: steps per transition.
      discount: gamma per environment step.
      priority_exponent: alpha; 0 samples uniformly.
      epsilon: added to |delta| so that no priority is zero.
      seed: the sampler's random state.
      random_shift: pixels of DrQ's random-shift augmentation of sampled stacks (0: off).
    """

    def __init__(self, capacity: int, frame_shape: Sequence[int], action_size: int, frame_stack: int, n_step: int,
                 discount: float, priority_exponent: float = 0.6, epsilon: float = 1e-6, seed: int = 0,
                 random_shift: int = 0):
        if not isinstance(capacity, int) or capacity < frame_stack + n_step + 1:
            raise ValueError(f"frame replay capacity must be an integer > frame_stack + n_step, got {capacity!r}.")
        if priority_exponent < 0:
            raise ValueError(f"priority_exponent must be >= 0, got {priority_exponent!r}.")
        if isinstance(random_shift, bool) or not isinstance(random_shift, int) or random_shift < 0:
            raise ConfigError(f"FrameReplay.random_shift={random_shift!r} must be an integer >= 0 (pixels).")
        self.random_shift = random_shift
        self.capacity, self.frame_shape = capacity, tuple(frame_shape)
        self.frame_stack, self.n_step, self.discount = int(frame_stack), int(n_step), float(discount)
        self.alpha, self.epsilon = float(priority_exponent), float(epsilon)
        self._frames = np.zeros((capacity,) + self.frame_shape, np.uint8)
        self._ids = np.full(capacity, -1, np.int64)      # id of the frame in each row; -1: empty
        self._prev = np.zeros(capacity, np.int64)        # id of the episode's previous frame (itself if first)
        self._succ = np.full(capacity, -1, np.int64)     # id of the episode's next frame; -1: none yet
        self._next = np.full(capacity, -1, np.int64)     # id of the frame of the transition's o_{t+m}
        self._action = np.zeros((capacity, action_size), np.float32)
        self._reward = np.zeros(capacity, np.float32)
        self._discount = np.zeros(capacity, np.float32)
        self._valid = np.zeros(capacity, bool)           # the row's transition can be sampled
        self._tree = SumTree(capacity)
        self._rng = np.random.default_rng(seed)
        self._streams: Dict[Hashable, _Stream] = {}
        self.frames_written = 0    # frames ever written; the next one's id
        self.inserted = 0          # environment steps ever added (each becomes one transition)
        self.max_priority = 1.0    # largest |delta| + epsilon seen (before the exponent)
        self._size = 0

    @property
    def size(self) -> int:
        """Transitions that can be sampled."""
        return self._size

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes held by the rows and the sum tree (the frames dominate)."""
        arrays = (self._frames, self._ids, self._prev, self._succ, self._next, self._action, self._reward,
                  self._discount, self._valid, self._tree._nodes)  # pylint: disable=protected-access
        return int(sum(a.nbytes for a in arrays))

    # -- writing ------------------------------------------------------------------------

    def _present(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        return (ids >= 0) & (self._ids[ids % self.capacity] == ids)

    def _drop(self, row: int) -> None:
        if self._valid[row]:
            self._valid[row] = False
            self._tree.set(row, 0.0)
            self._size -= 1

    def _write_frame(self, frame: np.ndarray, prev: Optional[int]) -> int:
        """Writes a frame (its episode's first if `prev` is None); returns its id."""
        frame_id = self.frames_written
        row = frame_id % self.capacity
        evicted = int(self._ids[row])
        if evicted >= 0:
            # The transitions whose stacks read the evicted frame: its own and its k - 1 successors'.
            self._drop(row)
            successor = int(self._succ[row])
            for _ in range(self.frame_stack - 1):
                if successor < 0 or not self._present(successor):
                    break
                self._drop(successor % self.capacity)
                successor = int(self._succ[successor % self.capacity])
        self._frames[row] = frame
        self._ids[row] = frame_id
        self._prev[row] = frame_id if prev is None else prev
        self._succ[row] = self._next[row] = -1
        if prev is not None and self._present(prev):
            self._succ[prev % self.capacity] = frame_id
        self.frames_written += 1
        return frame_id

    def start(self, stream: Hashable, frame: np.ndarray) -> None:
        """Begins an episode of `stream` at `frame`; the steps of its unfinished one are dropped."""
        state = self._streams.setdefault(stream, _Stream())
        state.window.clear()
        state.current = self._write_frame(frame, prev=None)

    def add(self, stream: Hashable, action: np.ndarray, reward: float, discount: float, next_frame: np.ndarray,
            last: bool) -> None:
        """Records one step of `stream` from its current frame; completes what it can."""
        state = self._streams.get(stream)
        if state is None or state.current < 0:
            raise RuntimeError(f"FrameReplay.add for stream {stream!r} before start(): begin each episode "
                               "with start(stream, frame).")
        current = state.current
        if self._present(current):
            self._action[current % self.capacity] = np.asarray(action, np.float32).reshape(-1)
        state.window.append((current, float(reward), float(discount)))
        state.current = self._write_frame(next_frame, prev=current)
        self.inserted += 1
        if len(state.window) == self.n_step:
            self._complete(state)
        if last:
            while state.window:
                self._complete(state)
            state.current = -1

    def add_steps(self, stream: Hashable, steps: Dict[str, np.ndarray]) -> None:
        """Adds an actor's steps (`STEP_FIELDS` arrays, in order); a step flagged `first`
        starts an episode at its `frame`. Steps of an episode whose start this replay never
        saw (its stream has none open) are counted and skipped."""
        for i in range(len(steps["reward"])):
            if steps["first"][i]:
                self.start(stream, steps["frame"][i])
            state = self._streams.get(stream)
            if state is None or state.current < 0:
                self.inserted += 1
                continue
            self.add(stream, steps["action"][i], steps["reward"][i], steps["discount"][i], steps["next_frame"][i],
                     bool(steps["last"][i]))

    def _stack_ids(self, ids: np.ndarray) -> list:
        """The ids of stack(g) for each g in `ids`, oldest first (k arrays)."""
        chain = [np.asarray(ids, np.int64)]
        for _ in range(self.frame_stack - 1):
            chain.append(self._prev[chain[-1] % self.capacity])
        return chain[::-1]

    def _complete(self, state: _Stream) -> None:
        """Writes the transition of the stream's oldest pending step, ending at its current frame."""
        reward, scale = 0.0, 1.0
        for _, r, d in state.window:
            reward += scale * r
            scale *= self.discount * d
        first, _, _ = state.window.popleft()
        reads = self._stack_ids(np.array([first, state.current]))
        if not all(self._present(ids).all() for ids in reads):
            return  # a frame it reads was overwritten (a stream far behind the others)
        row = first % self.capacity
        self._reward[row], self._discount[row], self._next[row] = reward, scale, state.current
        self._valid[row] = True
        self._size += 1
        self._tree.set(row, self.max_priority ** self.alpha)

    # -- sampling -----------------------------------------------------------------------

    def stacks(self, ids: np.ndarray) -> np.ndarray:
        """stack(g) for each frame id g: uint8 [len(ids), H, W, k * C], oldest frame first."""
        return np.concatenate([self._frames[chain % self.capacity] for chain in self._stack_ids(ids)], axis=-1)

    def sample(self, batch_size: int, beta: float) -> Dict[str, np.ndarray]:
        """`batch_size` transitions drawn by priority, with their importance weights.

        Returns:
          observation, next_observation (uint8 stacks), action, reward, discount (float32),
          "index" (rows), "item" (frame ids, for `update_priorities`) and "weight".
        """
        if self._size == 0:
            raise ValueError("replay.sample on a replay with no complete transition.")
        rows = self._tree.sample(batch_size, self._rng)
        probabilities = self._tree.get(rows) / self._tree.total
        weights = (self._size * probabilities) ** -float(beta)
        observation, next_observation = self.stacks(self._ids[rows]), self.stacks(self._next[rows])
        if self.random_shift:
            observation = random_shift(observation, self.random_shift, self._rng)
            next_observation = random_shift(next_observation, self.random_shift, self._rng)
        return {"observation": observation, "action": self._action[rows].copy(),
                "reward": self._reward[rows].copy(), "discount": self._discount[rows].copy(),
                "next_observation": next_observation, "index": rows, "item": self._ids[rows].copy(),
                "weight": (weights / weights.max()).astype(np.float32)}

    def update_priorities(self, rows: np.ndarray, items: np.ndarray, td_errors: np.ndarray) -> int:
        """Sets p = (|td| + epsilon) ** alpha for rows that still hold `items` and a transition."""
        rows, items = np.asarray(rows, np.int64), np.asarray(items, np.int64)
        raw = np.abs(np.asarray(td_errors, np.float64)) + self.epsilon
        if not np.all(np.isfinite(raw)):
            raise ValueError("replay.update_priorities got non-finite TD errors.")
        current = (self._ids[rows] == items) & self._valid[rows]
        if np.any(current):
            self._tree.set(rows[current], raw[current] ** self.alpha)
            self.max_priority = max(self.max_priority, float(raw[current].max()))
        return int(current.sum())

    def priorities(self) -> np.ndarray:
        """The sampling priority of every filled row (0 where no transition can be sampled)."""
        return self._tree.leaves[:min(self.frames_written, self.capacity)].copy()

    def transitions(self) -> np.ndarray:
        """Frame ids of the transitions that can be sampled (for tests and inspection)."""
        return np.sort(self._ids[self._valid])

    # -- state for checkpoints ------------------------------------------------------------

    def state(self) -> Dict[str, np.ndarray]:
        """Rows, priorities, streams, counters and sampler state, as numpy arrays."""
        filled = min(self.frames_written, self.capacity)
        out = {name: getattr(self, f"_{name}")[:filled].copy() for name in
               ("frames", "ids", "prev", "succ", "next", "action", "reward", "discount", "valid")}
        keys = list(self._streams)
        windows = np.zeros((len(keys), self.n_step, 3), np.float64)
        lengths = np.zeros(len(keys), np.int64)
        for i, key in enumerate(keys):
            lengths[i] = len(self._streams[key].window)
            if lengths[i]:
                windows[i, :lengths[i]] = np.array(self._streams[key].window, np.float64)
        out.update(priorities=self._tree.leaves[:filled].copy(),
                   counters=np.array([self.frames_written, self.inserted, self.capacity, self._size], np.int64),
                   max_priority=np.array(self.max_priority, np.float64),
                   rng=np.array(json.dumps(self._rng.bit_generator.state)),
                   stream_keys=np.array(json.dumps(keys)),
                   stream_current=np.array([self._streams[k].current for k in keys], np.int64),
                   stream_windows=windows, stream_lengths=lengths)
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Loads what `state()` returned, into a replay of the same capacity and shapes."""
        frames_written, inserted, capacity, size = (int(v) for v in state["counters"])
        if capacity != self.capacity:
            raise ValueError(f"the checkpoint's frame replay has capacity {capacity}, this run's {self.capacity}: "
                             "resume with the replay capacity the run started with.")
        if state["frames"].shape[1:] != self.frame_shape or state["action"].shape[1:] != self._action.shape[1:]:
            raise ValueError(f"the checkpoint's frames are {state['frames'].shape[1:]} with actions "
                             f"{state['action'].shape[1:]}, this run's {self.frame_shape} and "
                             f"{self._action.shape[1:]} (another environment or frame size?).")
        filled = min(frames_written, capacity)
        for name in ("frames", "ids", "prev", "succ", "next", "action", "reward", "discount", "valid"):
            getattr(self, f"_{name}")[:filled] = state[name]
        self._ids[filled:] = -1
        self._valid[filled:] = False
        leaves = np.zeros(capacity, np.float64)
        leaves[:filled] = state["priorities"]
        self._tree.restore(leaves)
        self.frames_written, self.inserted, self._size = frames_written, inserted, size
        self.max_priority = float(state["max_priority"])
        self._rng.bit_generator.state = json.loads(str(state["rng"]))
        self._streams = {}
        for key, current, window, length in zip(json.loads(str(state["stream_keys"])), state["stream_current"],
                                                state["stream_windows"], state["stream_lengths"], strict=True):
            stream = self._streams[key] = _Stream()
            stream.current = int(current)
            stream.window.extend((int(i), float(r), float(d)) for i, r, d in window[:int(length)])


class FrameAdder:
    """`NStepAdder`'s interface on one stream of a `FrameReplay`: takes the environment's
    stacked observations and hands the replay their newest frame.

    Args:
      replay: a `FrameReplay`.
      stream: this actor's stream key.
    """

    def __init__(self, replay: FrameReplay, stream: Hashable = 0):
        self._replay, self._stream = replay, stream
        self._channels = replay.frame_shape[-1]

    def state(self) -> Dict[str, np.ndarray]:
        """Nothing: the episode in progress (its current frame and pending steps) is the
        replay's stream, in `FrameReplay.state()`."""
        return {}

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        del state   # the replay's state holds the stream

    def start(self, observation: np.ndarray) -> None:
        self._replay.start(self._stream, observation[..., -self._channels:])

    def add(self, action: np.ndarray, reward: float, discount: float, next_observation: np.ndarray,
            last: bool) -> None:
        self._replay.add(self._stream, action, reward, discount, next_observation[..., -self._channels:], last)


class StepBuffer:
    """An actor process's steps (the adder interface), sent in one call as `STEP_FIELDS`
    arrays: each step's frame and next frame (the newest of each stacked observation),
    action, reward, discount, and whether it starts or ends an episode.

    Args:
      frame_channels: channels of one frame (3 for RGB).
    """

    def __init__(self, frame_channels: int = 3):
        self._channels = frame_channels
        self.rows = []
        self._frame: Optional[np.ndarray] = None
        self._first = False

    def start(self, observation: np.ndarray) -> None:
        self._frame, self._first = observation[..., -self._channels:].copy(), True

    def add(self, action: np.ndarray, reward: float, discount: float, next_observation: np.ndarray,
            last: bool) -> None:
        next_frame = next_observation[..., -self._channels:].copy()
        # Reward and discount stay float64, as the learner's own n-step sums use them.
        self.rows.append((self._frame, np.asarray(action, np.float32), np.float64(reward), np.float64(discount),
                          next_frame, np.float32(self._first), np.float32(last)))
        self._frame, self._first = next_frame, False

    def drain(self) -> Dict[str, np.ndarray]:
        rows, self.rows = self.rows, []
        return {name: np.stack([row[i] for row in rows]) for i, name in enumerate(STEP_FIELDS)}
