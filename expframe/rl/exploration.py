"""Exploration noise that decays with the learner's steps (DrQ-v2's schedule).

DrQ-v2 (Yarats et al. 2021, arXiv 2107.09645), a DDPG agent from pixels, explores with
Gaussian noise whose standard deviation falls linearly from 1.0 to 0.1 over its first
100,000 agent steps. A pixel policy that explores with a small constant sigma from the
start can settle on one action (push the cart one way) before its critic tells states
apart, and the noise around that action never shows the critic anything else.

The schedule is a function of the learner step, so every actor reads it from the
weights it acts with (their version is the learner step that published them): the
same noise in the learner's process, in actor processes and after a resume.

Example:
    schedule = ExplorationSchedule(initial=1.0, decay_steps=10_000)
    schedule(0, 0.3), schedule(5_000, 0.3), schedule(20_000, 0.3)   # 1.0, 0.65, 0.3
    ExplorationSchedule(None, 0)(123, 0.3)                            # 0.3: constant
"""

from typing import NamedTuple, Optional


class ExplorationSchedule(NamedTuple):
    """sigma(step) = initial + min(1, step / decay_steps) * (final - initial); `final` is
    the actor's own sigma. `initial=None`: the actor's sigma at every step."""

    initial: Optional[float]
    decay_steps: int

    def __call__(self, step: int, final: float) -> float:
        if self.initial is None or step >= self.decay_steps:
            return float(final)
        fraction = max(0, int(step)) / self.decay_steps
        return float(self.initial + fraction * (final - self.initial))
