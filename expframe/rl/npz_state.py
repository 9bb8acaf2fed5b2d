"""Named numpy arrays as bytes and back (numpy's .npz format, no pickle): how acting state
goes into a checkpoint (`D4PGTask`'s acting state) and from an actor process to the learner
(lockstep actors send their state with each chunk, `expframe.rl.lockstep`)."""

import io
import zipfile
from typing import Dict

import numpy as np


def npz_bytes(arrays: Dict[str, np.ndarray]) -> bytes:
    """`arrays` in numpy's .npz format (what `np.savez` writes, `np.load` reads; no pickle),
    with every entry dated 1980-01-01: the same arrays give the same bytes, whenever written."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, value in arrays.items():
            entry = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(entry, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)
    return buffer.getvalue()


def npz_arrays(blob: bytes) -> Dict[str, np.ndarray]:
    """The arrays `npz_bytes` wrote ({} for empty bytes)."""
    if not blob:
        return {}
    with np.load(io.BytesIO(blob), allow_pickle=False) as arrays:
        return {name: arrays[name] for name in arrays.files}
