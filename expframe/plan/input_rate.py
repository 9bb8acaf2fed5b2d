"""How fast one CPU core preprocesses ImageNet's training images: expframe/plan/input_rate.json.

The planner's input bound (input_bound.py) divides a host's images per step by its cores
times this rate. The file holds the measured rate and where it comes from, in the fields a
benchmark's result has (benchmarks/results/imagenet_input.json: images_per_sec_per_core,
cpu, source), so that replacing the measurement is an edit of the file; other fields are
ignored. A missing or malformed file or field is one line naming the file and the field
(ConfigError). Plain Python.
"""

import dataclasses
import json
import os
from typing import Optional

from expframe.errors import ConfigError

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "input_rate.json")
_FIX = "fix the file, or state the input time with --input_us_per_example"


@dataclasses.dataclass(frozen=True)
class InputRate:
    """A measured per-core rate: images/s of the train preprocessing on one core of `cpu`."""
    images_per_sec_per_core: float
    cpu: str
    source: str
    path: str


def load(path: Optional[str] = None) -> InputRate:
    """The rate `path` (default: DEFAULT, input_rate.json) holds; ConfigError (one line: the
    file, the field, what to do) if it cannot be read or a field is missing or malformed."""
    path = path or DEFAULT
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the input rate ({e.strerror}); {_FIX}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON (line {e.lineno}: {e.msg}); {_FIX}") from None
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: must hold one JSON object (images_per_sec_per_core, cpu, source); {_FIX}")
    for field in ("images_per_sec_per_core", "cpu", "source"):
        if field not in entry:
            raise ConfigError(f"{path}: field '{field}' is missing; {_FIX}")
    rate = entry["images_per_sec_per_core"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ConfigError(f"{path}: field 'images_per_sec_per_core' must be a positive number (images/s on one "
                          f"core), got {rate!r}; {_FIX}")
    for field in ("cpu", "source"):
        if not isinstance(entry[field], str) or not entry[field].strip():
            raise ConfigError(f"{path}: field '{field}' must be a non-empty text (what was measured, and where), got "
                              f"{entry[field]!r}; {_FIX}")
    return InputRate(float(rate), entry["cpu"], entry["source"], path)


def shown(path: str) -> str:
    """`path` as a plan's notes print it: the shipped file by its path in the repository."""
    return "expframe/plan/input_rate.json" if os.path.abspath(path) == DEFAULT else path
