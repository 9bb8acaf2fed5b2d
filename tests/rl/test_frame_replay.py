"""The frame replay: stacks and n-step pairs rebuilt by index equal a naive replay that writes
every transition out whole (interleaved actors, episode ends, ring wrap-around), memory per
transition, checkpoint round trip and resume, and the actor-process step stream."""

import collections
import io
import tracemalloc

import numpy as np

from expframe.rl.adders import NStepAdder
from expframe.rl.frame_replay import FrameAdder, FrameReplay, StepBuffer
from tests.support import TestCase

K, N, GAMMA, SHAPE = 3, 3, 0.9, (4, 4, 3)


def _frame(frame_id):
    """A frame whose pixels spell its id, so a stack names the frames it holds."""
    frame = np.zeros(SHAPE, np.uint8)
    frame[..., 0], frame[..., 1], frame[..., 2] = frame_id % 256, frame_id // 256 % 256, 7
    return frame


def _ids_of(stack):
    return [int(stack[0, 0, 3 * j]) + 256 * int(stack[0, 0, 3 * j + 1]) for j in range(K)]


class _StackingEnv:
    """What the environment does: a deque of the last K frames, the first repeated."""

    def __init__(self):
        self.frames = collections.deque(maxlen=K)

    def reset(self, frame):
        for _ in range(K):
            self.frames.append(frame)
        return np.concatenate(self.frames, -1)

    def step(self, frame):
        self.frames.append(frame)
        return np.concatenate(self.frames, -1)


class _Naive:
    """The replay it replaces: whole stacked transitions (NStepAdder into a list)."""

    def __init__(self):
        self.rows = []

    def add(self, **row):
        self.rows.append(row)


def _episodes(seed, streams=3, steps=600):
    """Interleaved chunks of several actors' episodes: (stream, kind, payload) events in
    arrival order, with global frame ids as the replay will number them. Stream 0 is slow
    (a chunk in 25), so its open episode can fall out of a small ring before it ends."""
    rng = np.random.default_rng(seed)
    weights = np.array([4.0] + [48.0] * (streams - 1)) if streams > 1 else np.ones(1)
    left = {s: 0 for s in range(streams)}          # steps left in each stream's episode
    events, frame_id, taken = [], 0, 0
    while taken < steps:
        stream = int(rng.choice(streams, p=weights / weights.sum()))
        for _ in range(int(rng.integers(1, 6))):     # a chunk of this actor's steps
            if left[stream] == 0:
                left[stream] = int(rng.integers(1, 12))
                events.append((stream, "start", frame_id))
                frame_id += 1
            left[stream] -= 1
            terminal = left[stream] == 0 and rng.random() < 0.5
            events.append((stream, "step", dict(frame=frame_id, action=rng.normal(size=2).astype(np.float32),
                                                 reward=float(rng.random()), discount=0.0 if terminal else 1.0,
                                                 last=left[stream] == 0)))
            frame_id += 1
            taken += 1
    return events


def _feed(events, replay, naive=None):
    envs, adders = collections.defaultdict(_StackingEnv), {}
    for stream, kind, payload in events:
        if stream not in adders:
            adders[stream] = [FrameAdder(replay, stream)] + ([NStepAdder(naive, N, GAMMA)] if naive else [])
        if kind == "start":
            observation = envs[stream].reset(_frame(payload))
            for adder in adders[stream]:
                adder.start(observation)
        else:
            observation = envs[stream].step(_frame(payload["frame"]))
            for adder in adders[stream]:
                adder.add(payload["action"], payload["reward"], payload["discount"], observation, payload["last"])


class FrameReplayTest(TestCase):

    def test_transitions_rebuilt_by_index_equal_the_naive_ones(self):
        for capacity in (10_000, 41):   # everything kept; a ring overwritten several times
            replay, naive = FrameReplay(capacity, SHAPE, 2, K, N, GAMMA, seed=0), _Naive()
            _feed(_episodes(seed=1), replay, naive)
            steps = sum(kind == "step" for _, kind, _ in _episodes(seed=1))
            # One transition per step; the last n - 1 steps of open episodes are pending in both.
            self.assertEqual(replay.inserted, steps)
            self.assertEqual(replay.size if capacity > 1000 else len(naive.rows), len(naive.rows))
            oldest_kept = replay.frames_written - capacity
            by_id = {}
            for row in naive.rows:
                reads = _ids_of(row["observation"]) + _ids_of(row["next_observation"])
                if min(reads) >= oldest_kept:
                    by_id[_ids_of(row["observation"])[-1]] = row
            # Exactly the naive transitions whose 2k frames are still in the ring can be sampled.
            np.testing.assert_array_equal(replay.transitions(), sorted(by_id))
            self.assertEqual(replay.size, len(by_id))
            if capacity == 41:
                self.assertGreater(replay.frames_written, 4 * capacity)
                self.assertLess(len(by_id), len(naive.rows) // 3)
            ids = replay.transitions()
            np.testing.assert_array_equal(replay.stacks(ids), np.stack([by_id[i]["observation"] for i in ids]))
            batch = replay.sample(256, beta=0.5)
            for i, frame_id in enumerate(batch["item"]):
                expected = by_id[int(frame_id)]
                for name in ("observation", "next_observation", "action", "reward", "discount"):
                    np.testing.assert_array_equal(batch[name][i], expected[name], err_msg=name)
            self.assertEqual(batch["observation"].dtype, np.uint8)
            self.assertEqual(batch["observation"].shape, (256, 4, 4, 9))

    def test_episode_boundaries_in_the_stacks(self):
        replay = FrameReplay(100, SHAPE, 2, K, N, GAMMA)
        _feed([(0, "start", 0), (0, "step", dict(frame=1, action=np.ones(2, np.float32), reward=1.0,
                                                 discount=0.0, last=True)),
               (0, "start", 2)] + [(0, "step", dict(frame=3 + t, action=np.ones(2, np.float32), reward=1.0,
                                                    discount=1.0, last=t == 4)) for t in range(5)], replay)
        # Frame 2 starts an episode: the stacks from it repeat it, never reach into frames 0-1.
        self.assertEqual(_ids_of(replay.stacks(np.array([2]))[0]), [2, 2, 2])
        self.assertEqual(_ids_of(replay.stacks(np.array([3]))[0]), [2, 2, 3])
        self.assertEqual(_ids_of(replay.stacks(np.array([5]))[0]), [3, 4, 5])
        batch = {int(i): j for j, i in enumerate(replay.sample(512, 0.0)["item"])}
        self.assertEqual(sorted(batch), [0, 2, 3, 4, 5, 6])   # one per step; final frames 1, 7 start none
        sample = replay.sample(512, 0.0)
        row = list(sample["item"]).index(0)
        # A terminal step: one reward, no bootstrap.
        self.assertEqual((sample["reward"][row], sample["discount"][row]), (1.0, 0.0))
        row = list(sample["item"]).index(5)
        # Truncated at the episode's end: 2 steps (frames 5, 6 -> 7), gamma^2.
        self.assertAlmostEqual(float(sample["reward"][row]), 1.0 + GAMMA, places=6)
        self.assertAlmostEqual(float(sample["discount"][row]), GAMMA ** 2, places=6)
        self.assertEqual(_ids_of(sample["next_observation"][row]), [5, 6, 7])

    def test_memory_is_about_one_frame_per_transition(self):
        frame_shape, capacity = (64, 64, 3), 2_000
        tracemalloc.start()   # numpy reports its buffers to tracemalloc; all are made up front
        before = tracemalloc.get_traced_memory()[0]
        replay = FrameReplay(capacity, frame_shape, 1, K, 5, 0.99)
        allocated = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        frames = np.random.default_rng(0).integers(0, 256, (8,) + frame_shape, dtype=np.uint8)
        while replay.frames_written < capacity:   # episodes of 125 steps, as cartpole at action repeat 8
            replay.start(0, frames[0])
            for t in range(125):
                replay.add(0, np.zeros(1), 0.5, 1.0, frames[t % 8], t == 124)
        frame_bytes = int(np.prod(frame_shape))
        per_transition = allocated / replay.size
        # One frame (12,288 bytes) per transition, plus about 80 bytes of indices, action, reward
        # and priority, plus the episodes' last frames (1 in 126): not the 2 x 3 frames
        # (73,728 bytes as uint8) of transitions written out whole.
        self.assertLess(abs(replay.nbytes - allocated), 10_000)
        self.assertLess(per_transition, frame_bytes * 126 / 125 + 100)
        self.assertGreater(per_transition, frame_bytes)
        self.assertLess(per_transition, 2 * K * frame_bytes / 5.5)
        print(f"frame replay: {per_transition:.0f} bytes per transition at 64x64x3 "
              f"({per_transition * 1e5 / 2**30:.3f} GiB per 100k)")

    def test_state_round_trip_resumes_exactly(self):
        events = _episodes(seed=2, steps=600)
        cut = len(events) // 2
        uninterrupted = FrameReplay(150, SHAPE, 2, K, N, GAMMA, seed=3)
        resumed = FrameReplay(150, SHAPE, 2, K, N, GAMMA, seed=3)
        # Both see the first half (with sampling and priority updates); one goes through
        # a checkpoint (numpy's npz, as D4PGTask saves it) into a fresh replay.
        envs_a, envs_b = {}, {}
        _feed_with_updates(events[:cut], uninterrupted, envs_a)
        _feed_with_updates(events[:cut], resumed, envs_b)
        buffer = io.BytesIO()
        np.savez(buffer, **resumed.state())
        fresh = FrameReplay(150, SHAPE, 2, K, N, GAMMA, seed=99)
        with np.load(io.BytesIO(buffer.getvalue()), allow_pickle=False) as arrays:
            fresh.restore({k: arrays[k] for k in arrays.files})
        # The second half continues the episodes open at the cut, in both.
        a = _feed_with_updates(events[cut:], uninterrupted, envs_a)
        b = _feed_with_updates(events[cut:], fresh, envs_b)
        self.assertGreater(len(a), 3)
        for x, y in zip(a, b, strict=True):
            for name in x:
                np.testing.assert_array_equal(x[name], y[name], err_msg=name)
        for name, value in uninterrupted.state().items():
            np.testing.assert_array_equal(value, fresh.state()[name], err_msg=name)
        with self.assertRaisesRegex(ValueError, "capacity 150, this run's 151"):
            FrameReplay(151, SHAPE, 2, K, N, GAMMA).restore(uninterrupted.state())

    def test_step_stream_of_an_actor_process_equals_acting_in_the_learner(self):
        events = _episodes(seed=4, streams=1, steps=120)
        direct = FrameReplay(1000, SHAPE, 2, K, N, GAMMA)
        _feed(events, direct)
        buffer, sent = StepBuffer(3), FrameReplay(1000, SHAPE, 2, K, N, GAMMA)
        env = _StackingEnv()
        for i, (_, kind, payload) in enumerate(events):
            if kind == "start":
                buffer.start(env.reset(_frame(payload)))
            else:
                buffer.add(payload["action"], payload["reward"], payload["discount"],
                           env.step(_frame(payload["frame"])), payload["last"])
            if i % 17 == 16 or i == len(events) - 1:   # chunks cut anywhere, mid-episode too
                if buffer.rows:
                    sent.add_steps(7, buffer.drain())
        for name in ("frames", "ids", "prev", "next", "action", "reward", "discount", "valid", "priorities"):
            np.testing.assert_array_equal(direct.state()[name], sent.state()[name], err_msg=name)
        self.assertEqual(sent.inserted, direct.inserted)


def _feed_with_updates(events, replay, envs):
    """Feeds events in chunks, sampling and updating priorities between them; returns the samples."""
    samples, rng = [], np.random.default_rng(5)
    for start in range(0, len(events), 40):
        for stream, kind, payload in events[start:start + 40]:
            env = envs.setdefault(stream, _StackingEnv())
            adder = FrameAdder(replay, stream)
            if kind == "start":
                adder.start(env.reset(_frame(payload)))
            else:
                adder.add(payload["action"], payload["reward"], payload["discount"], env.step(_frame(payload["frame"])),
                          payload["last"])
        if replay.size:
            batch = replay.sample(16, beta=0.6)
            samples.append(batch)
            replay.update_priorities(batch["index"], batch["item"], rng.normal(size=16))
    return samples
