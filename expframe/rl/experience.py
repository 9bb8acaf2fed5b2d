"""How experience goes from acting into the learner's replay, for state features or pixels.

  state features   the actor's `NStepAdder` writes whole n-step transitions
                   (`FIELDS`, float32) into a `PrioritizedReplay`; actor processes send
                   those transitions.
  pixels           the actor's adder hands each step's newest frame to a `FrameReplay`
                   (one frame stored per step; stacks and n-step pairs rebuilt by index);
                   actor processes send their steps (`STEP_FIELDS`: uint8 frames, actions,
                   rewards, discounts, episode starts and ends) and the learner's replay
                   builds the transitions, one stream per actor.

An environment observes pixels when it has a `frame_shape` (`expframe/rl/pixels.py`).
"""

from typing import Any, Dict, List, Tuple

import numpy as np

from expframe.rl.adders import NStepAdder
from expframe.rl.frame_replay import STEP_FIELDS, FrameAdder, FrameReplay, StepBuffer
from expframe.rl.replay import PrioritizedReplay
from expframe.rl.rpc import FIELDS


class TransitionBuffer:
    """Collects transitions as a replay would (`add(**fields)`), for sending in one call."""

    def __init__(self):
        self.rows: List[Dict[str, np.ndarray]] = []

    def add(self, **fields: np.ndarray) -> None:
        self.rows.append(fields)

    def drain(self) -> Dict[str, np.ndarray]:
        rows, self.rows = self.rows, []
        return {f: np.stack([np.asarray(r[f], np.float32) for r in rows]) for f in FIELDS}


def observes_pixels(environment) -> bool:
    return getattr(environment, "frame_shape", None) is not None


def observation_spec(environment) -> Tuple[Tuple[int, ...], Any]:
    """(shape, dtype) of one observation: float32 features, or uint8 stacked frames."""
    shape = tuple(getattr(environment, "observation_shape", (environment.observation_size,)))
    return shape, np.dtype(getattr(environment, "observation_dtype", np.float32))


def make_replay(environment, capacity: int, n_step: int, discount: float, priority_exponent: float, seed: int):
    """The replay for this environment's observations."""
    act = environment.action_size
    if observes_pixels(environment):
        return FrameReplay(capacity, environment.frame_shape, act, environment.frame_stack, n_step, discount,
                           priority_exponent=priority_exponent, seed=seed)
    obs = environment.observation_size
    return PrioritizedReplay(capacity, {"observation": (obs,), "action": (act,), "reward": (), "discount": (),
                                        "next_observation": (obs,)}, priority_exponent=priority_exponent, seed=seed)


def make_adder(replay, n_step: int, discount: float, stream: int = 0):
    """What an in-process actor writes its steps through (one stream of a frame replay)."""
    if isinstance(replay, FrameReplay):
        return FrameAdder(replay, stream)
    return NStepAdder(replay, n_step, discount)


def rpc_fields(environment) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """The fields actor processes send, in order, with shapes and dtypes."""
    act = environment.action_size
    if observes_pixels(environment):
        frame = tuple(environment.frame_shape)
        shapes = {"frame": (frame, "uint8"), "action": ((act,), "float32"), "reward": ((), "float64"),
                  "discount": ((), "float64"), "next_frame": (frame, "uint8"), "first": ((), "float32"),
                  "last": ((), "float32")}
        assert tuple(shapes) == STEP_FIELDS
        return shapes
    obs = (environment.observation_size,)
    return dict(zip(FIELDS, [(obs, "float32"), ((act,), "float32"), ((), "float32"), ((), "float32"),
                             (obs, "float32")], strict=True))


def actor_buffer(environment, n_step: int, discount: float) -> Tuple[Any, Any]:
    """(buffer, adder) of an actor process: the adder writes steps, the buffer sends them."""
    if observes_pixels(environment):
        buffer = StepBuffer(environment.frame_shape[-1])
        return buffer, buffer
    buffer = TransitionBuffer()
    return buffer, NStepAdder(buffer, n_step, discount)


def add_chunk(replay, actor_id: int, fields: Dict[str, np.ndarray]) -> int:
    """Adds one actor's chunk (the service's fields) to the replay; returns the rows added."""
    if isinstance(replay, FrameReplay):
        replay.add_steps(actor_id, fields)
    else:
        replay.add(**fields)
    return len(fields["reward"])


def ingest(replay, service) -> int:
    """Moves the service's pending inserts into the replay; returns the steps moved."""
    if isinstance(replay, FrameReplay):
        count = 0
        for actor_id, steps in service.take_inserts():
            replay.add_steps(actor_id, steps)
            count += len(steps["reward"])
        return count
    taken = service.take()
    if taken:
        replay.add(**taken)
    return len(taken.get("reward", np.zeros(0)))
