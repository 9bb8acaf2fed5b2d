"""Where each worker's training input stands, saved with the checkpoints.

Every worker reads its own shard, so its data position (shuffle buffer included)
is its own. Worker 0's position travels inside the run's checkpoint (key `data`);
each other worker writes its own next to the chief's checkpoints, under
`checkpoints/data/<W>-workers/worker-<i>/step-<S>`, and reads it back on resume.
"""

import os
from typing import Any, Dict, Optional

import tensorflow as tf


class DataPosition:
    """The position of this worker's train iterator, for the Checkpointer.

    Args:
      replicator: the run's Replicator (worker count and index).
      iterator: a checkpointable (plain tf.data) iterator, or None when the position
        is not saved (parameter_server, or a task with `checkpoint_input = False`).
      max_to_keep: checkpoints kept by the run; a worker keeps one more position.
    """

    def __init__(self, replicator, iterator: Optional[Any], max_to_keep: int):
        self._rep = replicator
        self._iterator = iterator
        self._max_to_keep = max_to_keep
        self._own = None if iterator is None else tf.train.Checkpoint(data=iterator)

    def in_checkpoint(self) -> Dict[str, Any]:
        """What goes into the run's own checkpoint: this worker's iterator, if saved."""
        return {} if self._iterator is None else {"data": self._iterator}

    def _saves_its_own(self) -> bool:
        return self._own is not None and self._rep.num_workers > 1 and self._rep.worker_index > 0

    def _prefix(self, shared_dir: str, step: Optional[int] = None) -> str:
        folder = os.path.join(shared_dir, "data", f"{self._rep.num_workers}-workers",
                              f"worker-{self._rep.worker_index}")
        return folder if step is None else os.path.join(folder, f"step-{step}")

    def save(self, shared_dir: str, step: int) -> None:
        """A non-chief worker writes its position at `step` (before the chief's checkpoint)."""
        if not self._saves_its_own():
            return
        tf.io.gfile.makedirs(self._prefix(shared_dir))
        self._own.write(self._prefix(shared_dir, step))
        self._prune(shared_dir)

    def restore(self, shared_dir: str, step: int) -> None:
        """A non-chief worker reads its position at `step`; the chief's came with the checkpoint."""
        if not self._saves_its_own():
            return
        prefix = self._prefix(shared_dir, step)
        try:
            self._own.read(prefix).assert_consumed()
        except (tf.errors.OpError, ValueError, AssertionError) as e:
            print(f"expframe: worker {self._rep.worker_index} could not read its data position {prefix} "
                  f"({type(e).__name__}); it continues from the chief's, so its examples may repeat "
                  "or be skipped until the next epoch", flush=True)

    def _prune(self, shared_dir: str) -> None:
        """Keeps this worker's newest max_to_keep + 1 positions."""
        folder = self._prefix(shared_dir)
        steps = sorted(int(name[len("step-"):-len(".index")]) for name in tf.io.gfile.listdir(folder)
                       if name.startswith("step-") and name.endswith(".index"))
        for old in steps[:-(self._max_to_keep + 1)]:
            for path in tf.io.gfile.glob(os.path.join(folder, f"step-{old}.*")):
                tf.io.gfile.remove(path)
