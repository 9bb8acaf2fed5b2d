"""How sure a benchmark figure is: the spread of its paired ratios over repeats, a
bootstrap interval of their median, and a verdict against the figure's goal.

Every timing benchmark (benchmarks/*.py) times its runners interleaved, one host call
each per repeat, and divides call i of one by call i of the other: a *paired ratio*
per repeat. `of(values)` summarises them as hyperfine does (minimum, median, maximum)
and adds what Criterion adds, a percentile bootstrap interval of the median; the
benchmark writes it into its JSON result row under `spread`, and the results page
(`expframe.reproduce.page`) shows it beside the figure with the repeat count and,
where the figure has a goal, a `verdict`.

The `spread` object (schema `SCHEMA`), one per figure:

    {"n": 30,                       # the values (repeats, or points for "over": "points")
     "min": 0.91, "median": 0.974, "max": 1.03,
     "low": 0.95, "high": 1.00,     # the bootstrap interval of the median
     "confidence": 0.95, "resamples": 10000, "seed": 0,
     "over": "repeats",             # what was resampled: "repeats" (paired per repeat) or "points"
     "values": [...]}               # the values themselves, in repeat order

A result row's `spread` field maps each of its figures to one such object (e.g.
`{"expframe_over_handwritten": {...}, "expframe_over_keras_fit": {...}}`).

Orientation: a runner ratio is the speed of expframe over the speed of the other
runner (hand-written loop or Keras fit), so above 1 is expframe ahead; per repeat it is
`other's seconds / expframe's seconds` for the same work. Collectives report a cost
(all-reduce seconds / copy seconds: lower is better) and say so in their goal.

Goals (`parity`, `at_least`, `at_most`) and the verdict:
  parity     runner ratios: "ahead" when the whole interval is above 1.00, "behind" when
             it is below, "parity within noise" when it contains 1.00; a *regression*
             when the whole interval is below the floor (0.97: issue 3's goal for the
             train loop's overhead).
  at_least   e.g. weak scaling >= 0.90: "meets the goal" when the whole interval is at
  at_most    or above it (at or below for at_most), a *regression* when the whole
             interval is on the wrong side, "within noise of the goal" otherwise.
A figure without a goal (MFU, bytes, rates) shows its spread and no verdict; a
figure of one repeat gets no verdict (an interval of one value says nothing).

How many repeats (`REPEATS`). The issue's quiet re-measurement of ResNet-50 at the
page's setting (224 px, 2 replicas, batch 4, one step per call, 9 repeats) had calls
spanning 0.88-0.97 s (expframe), 0.86-0.98 s (hand-written) and 0.84-0.95 s (fit), the
"+-5-8 %" of one call. The expected range of 9 normal draws is 2.97 sigma, so one call's
sigma is 3.3-4.4 % (a 10-13 % range / 2.97). A paired ratio of two calls that share
nothing has sqrt(2) times that, at most 6.2 % (pairing removes shared drift, so a real
one is smaller); we size for 6.2 %.
  The textbook answer: the median of n values has a standard error of about
sqrt(pi / 2) sigma / sqrt(n) = 1.25 sigma / sqrt(n), so a 95 % interval is about
+-2.46 sigma / sqrt(n), within +-5 % at sigma 6.2 % from n >= (2.46 x 6.2 / 5)^2 = 9.3.
  The percentile bootstrap of a median of few values is coarser than that (it can only
land on order statistics, and the page takes the wider side). Simulated (`share_within`:
600 sittings of n lognormal ratios of sigma 6.2 %, 2,000 resamples each), the interval's
typical half-width and the share of sittings within +-5 % are: n = 10: 5.5 %, 40 %;
15: 4.8 %, 56 %; 20: 3.9 %, 80 %; 30: 3.2 %, 96 % (90th percentile 4.5 %).
Hence `REPEATS = 30`: within +-5 % in 19 sittings of 20 at the widest spread seen.
What it costs: at the page's ResNet-50 setting a repeat is 0.9 + 0.9 + 1.8 s (fit's call
times two executions), 1.8 minutes per 224 px configuration beside the 3 minutes its
three models take to build and trace; the whole benchmarks set is about 110 minutes
on 2 idle cores (docs/reproducing.md#benchmark-figures-spread-and-verdicts).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

SCHEMA = 1                 # bump when the spread object changes; benchmark records carry it
CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
REPEATS = 30               # the benchmarks set's repeats: a runner ratio's interval within +-5 % (above)
PARITY_FLOOR = 0.97        # a runner ratio is a regression when its whole interval is below this
TARGET_HALF_WIDTH = 0.05   # +-5 % of the median


def of(values: Sequence[float], over: str = "repeats", confidence: float = CONFIDENCE,
       resamples: int = RESAMPLES, seed: int = SEED) -> dict:
    """The spread of `values` (paired ratios, one per repeat): min, median, max and the
    percentile bootstrap interval of the median (`resamples` resamples with replacement,
    drawn by numpy's default generator seeded with `seed`, so the same values always give
    the same interval).

    Raises:
      ValueError: no values, or one that is not a finite number.
    """
    data = np.asarray([float(v) for v in values], dtype=np.float64)
    if data.size == 0 or not np.all(np.isfinite(data)):
        raise ValueError(f"a spread needs finite values, got {list(values)!r}")
    low, high = interval(data, confidence, resamples, seed)
    return {"n": int(data.size), "min": float(data.min()), "median": float(np.median(data)),
            "max": float(data.max()), "low": low, "high": high, "confidence": confidence,
            "resamples": resamples, "seed": seed, "over": over, "values": [float(v) for v in data]}


def interval(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
             seed: int = SEED) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of `values`."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 1:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    medians = np.median(data[rng.integers(0, data.size, size=(resamples, data.size))], axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def half_width(spread: dict) -> float:
    """The interval's larger distance from the median, as a fraction of the median."""
    return max(spread["median"] - spread["low"], spread["high"] - spread["median"]) / abs(spread["median"])


def check(spread, where: str) -> None:
    """Raises ValueError naming `where` unless `spread` is a spread object of this schema."""
    keys = ("n", "min", "median", "max", "low", "high", "confidence")
    if not isinstance(spread, dict) or any(not isinstance(spread.get(k), (int, float)) for k in keys):
        raise ValueError(f"{where}: its spread {spread!r} is not a spread object "
                         f"(expframe/reproduce/spread.py: {', '.join(keys)})")
    if not (spread["min"] <= spread["low"] <= spread["high"] <= spread["max"]
            and spread["min"] <= spread["median"] <= spread["max"]):
        raise ValueError(f"{where}: its spread is not ordered (min {spread['min']}, interval {spread['low']} to "
                         f"{spread['high']}, median {spread['median']}, max {spread['max']})")


# -- goals and verdicts ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Goal:
    """What a figure is judged against.

    Attributes:
      kind: "parity" (runner ratios: against 1.00), "at_least" or "at_most".
      value: the floor below which a parity figure is a regression (PARITY_FLOOR), or
        the bound of an at_least / at_most goal.
    """

    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in ("parity", "at_least", "at_most"):
            raise ValueError(f"goal kind {self.kind!r}: use parity, at_least or at_most")

    def text(self) -> str:
        if self.kind == "parity":
            return f"parity (1.00); regression below {self.value:g}"
        return f"goal {'>=' if self.kind == 'at_least' else '<='} {self.value:g}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_json(cls, data: dict) -> "Goal":
        return cls(data["kind"], float(data["value"]))


def parity(floor: float = PARITY_FLOOR) -> Goal:
    """A runner ratio's goal: 1.00, a regression below `floor`."""
    return Goal("parity", floor)


def at_least(value: float) -> Goal:
    return Goal("at_least", value)


def at_most(value: float) -> Goal:
    return Goal("at_most", value)


def regression(spread: dict, goal: Goal) -> bool:
    """Whether the whole interval falls on the wrong side of the goal (below the floor
    for parity). One repeat is never judged."""
    if spread["n"] < 2:
        return False
    if goal.kind == "at_most":
        return spread["low"] > goal.value
    return spread["high"] < goal.value


def verdict(spread: Optional[dict], goal: Optional[Goal]) -> str:
    """The page's verdict: '-' without a goal; see the module docstring."""
    if goal is None:
        return "-"
    if spread is None:
        return "no verdict: no spread"
    if spread["n"] < 2:
        return "no verdict: 1 repeat"
    low, high = spread["low"], spread["high"]
    if goal.kind == "parity":
        words = "ahead" if low > 1.0 else "behind" if high < 1.0 else "parity within noise"
        if regression(spread, goal):
            words += f"; **regression** (whole interval below {goal.value:g})"
        return words
    if regression(spread, goal):
        return f"**regression** (whole interval {'above' if goal.kind == 'at_most' else 'below'} {goal.value:g})"
    meets = low >= goal.value if goal.kind == "at_least" else high <= goal.value
    return "meets the goal" if meets else "within noise of the goal"


def share_within(sigma: float, n: int, half_width_goal: float = TARGET_HALF_WIDTH, trials: int = 600,
                 resamples: int = 2000, seed: int = SEED) -> float:
    """The share of simulated sittings whose interval is within +-`half_width_goal` of
    the median: each sitting n lognormal ratios of log sigma `sigma` (the arithmetic of
    `REPEATS`, by simulation)."""
    rng = np.random.default_rng(seed)
    widths = [half_width(of(np.exp(rng.normal(0.0, sigma, n)), resamples=resamples, seed=t)) for t in range(trials)]
    return float(np.mean(np.asarray(widths) <= half_width_goal))
