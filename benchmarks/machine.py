"""What every benchmark records about the machine it ran on (results compare only within one
run), and how it writes its result.

The same description every run records (`expframe.provenance`): CPU model, cores,
AVX-512 and native bfloat16, load average. `write_result` writes a benchmark's JSON
atomically (a reader never sees half a file), making its folder first.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout
sys.path.insert(0, ROOT)  # its expframe

from expframe.atomic_files import write_json  # noqa: E402
from expframe.provenance import cpu_name, load_average, machine  # noqa: E402

__all__ = ["ROOT", "cpu_name", "load_average", "machine", "write_result"]


def write_result(path: str, result: dict, indent: int = 2, say: bool = True, default=None) -> None:
    """Writes `result` as JSON to `path` atomically (`default`: as json.dumps's); prints
    `wrote PATH` unless `say` is False."""
    write_json(path, result, indent=indent, make_dirs=True, default=default)
    if say:
        print(f"wrote {path}")
