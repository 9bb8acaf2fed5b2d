"""`python -m expframe.rl.frame_strip MODEL_DIR --out frames.png`: frames a pixel D4PG agent saw.

Reads the newest checkpoint of a run with pixel observations (its frame replay is in the
checkpoint, `D4PGTask`'s acting state), picks the most recent stretch of one episode, and
writes its frames side by side as a PNG, oldest on the left, each scaled up `--scale`
times (nearest neighbour), one frame per environment step (`control_suite.action_repeat`
control steps apart). Exits 2 with one line when the run has no checkpoint or no frames.
"""

import argparse
import io
import sys
from typing import List, Optional, Sequence

import numpy as np

from expframe.errors import ConfigError

_STATE = "acting/.ATTRIBUTES/py_state"


def replay_arrays(model_dir: str) -> dict:
    """The frame replay's arrays (`FrameReplay.state()`) from the run's newest checkpoint."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    path = tf.train.latest_checkpoint(f"{model_dir}/checkpoints")
    if path is None:
        raise ConfigError(f"frame_strip: {model_dir}/checkpoints holds no checkpoint.")
    reader = tf.train.load_checkpoint(path)
    if _STATE not in reader.get_variable_to_shape_map():
        raise ConfigError(f"frame_strip: the checkpoint {path} has no acting state (not a D4PG run?).")
    with np.load(io.BytesIO(reader.get_tensor(_STATE)), allow_pickle=False) as arrays:
        out = {k[len("replay/"):]: arrays[k] for k in arrays.files if k.startswith("replay/")}
    if "frames" not in out:
        raise ConfigError(f"frame_strip: the run in {model_dir} has no frames (state-feature observations).")
    return out


def episode_frames(state: dict, count: int) -> List[np.ndarray]:
    """Up to `count` consecutive frames of one episode, ending at the newest frame that
    starts a transition (followed back through the episode's `prev` links)."""
    ids, prev, valid = state["ids"], state["prev"], state["valid"]
    capacity = int(state["counters"][2])
    if not valid.any():
        raise ConfigError("frame_strip: the replay holds no complete transition yet.")
    frame_id = int(ids[valid].max())
    chain = [frame_id]
    while len(chain) < count:
        previous = int(prev[chain[-1] % capacity])
        if previous == chain[-1] or ids[previous % capacity] != previous:
            break   # the episode's first frame, or one already overwritten
        chain.append(previous)
    return [state["frames"][i % capacity] for i in reversed(chain)]


def strip(frames: Sequence[np.ndarray], scale: int = 2, gap: int = 2) -> np.ndarray:
    """Frames side by side, `gap` white pixels apart, each scaled up `scale` times."""
    big = [np.kron(f, np.ones((scale, scale, 1), np.uint8)) for f in frames]
    height = big[0].shape[0]
    spacer = np.full((height, gap, 3), 255, np.uint8)
    parts = []
    for i, frame in enumerate(big):
        parts.extend([spacer] if i else [])
        parts.append(frame)
    return np.concatenate(parts, axis=1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--frames", type=int, default=12, help="consecutive frames to show")
    parser.add_argument("--scale", type=int, default=2, help="pixels per frame pixel")
    args = parser.parse_args(argv)
    try:
        frames = episode_frames(replay_arrays(args.model_dir), args.frames)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from PIL import Image  # pylint: disable=import-outside-toplevel
    Image.fromarray(strip(frames, args.scale)).save(args.out)
    print(f"wrote {len(frames)} frames to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
