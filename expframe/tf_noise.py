"""TensorFlow's start-up noise on stderr, hidden by default (`--tf_logs` shows it).

Importing TensorFlow and probing for devices writes lines from C++ straight to file
descriptor 2, before absl's logging is set up, so `TF_CPP_MIN_LOG_LEVEL` does not
hold them back: on a machine without GPUs, `failed call to cuInit` (an error-level
line), `Could not find cuda drivers`, the absl banner `WARNING: All log messages
before absl::InitializeLog() ...` (twice: two libraries each print it), and, at lower
log levels, the oneDNN and CPU-instruction notices.

`quiet_start()` sends fd 2 through a filter while TensorFlow starts: lines that match
`NOISE` (only these) are dropped, every other line (a real warning or error) goes
to stderr as it comes. After start-up fd 2 is the terminal again, so nothing later
is filtered.
"""

import contextlib
import os
import re
import sys
import threading
from typing import Iterator, List

# Each pattern names the source file TensorFlow logs it from, so an unrelated line
# that happens to mention CUDA is not hidden.
NOISE = tuple(re.compile(p) for p in (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
    r"cuda_(?:platform|executor|diagnostics)\.cc:\d+\] (?:failed call to cuInit|retrieving CUDA diagnostic"
    r"|hostname:|libcuda reported version|kernel reported version|kernel driver does not appear to be running)",
    r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use available CPU instructions",
    r"^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.$",
    r"oneDNN custom operations are on\. You may see slightly different numerical results",
    r"Unable to register cu(?:DNN|FFT|BLAS) factory: Attempting to register factory",
    r"computation_placer\.cc:\d+\] computation placer already registered",
    r"TF-TRT Warning: Could not find TensorRT",
))


def is_noise(line: str) -> bool:
    """Whether `line` is one of TensorFlow's start-up notices that `quiet_start` drops."""
    return any(p.search(line) for p in NOISE)


@contextlib.contextmanager
def quiet_start(enabled: bool = True) -> Iterator[List[str]]:
    """While inside, lines written to fd 2 that `is_noise` are dropped (collected in the
    yielded list); all others pass to stderr unchanged, line by line."""
    hidden: List[str] = []
    if not enabled:
        yield hidden
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump():
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                text = line.decode("utf-8", errors="replace").rstrip("\n")
                if is_noise(text):
                    hidden.append(text)
                else:
                    os.write(saved, line)

    thread = threading.Thread(target=pump, name="expframe-tf-noise", daemon=True)
    thread.start()
    try:
        yield hidden
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump reads to its end
        thread.join(timeout=5.0)
        os.close(saved)
