"""What every benchmark records about the machine it ran on (results compare only within one run).

The same description every run records (`expframe.provenance`): CPU model, cores,
AVX-512 and native bfloat16, load average.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's expframe

from expframe.provenance import cpu_name, load_average, machine  # noqa: E402

__all__ = ["cpu_name", "load_average", "machine"]
