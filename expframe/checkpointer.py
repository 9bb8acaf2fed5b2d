"""The run's checkpoints: what is saved (step, the task's trackables, the data position),
where, and the policy for restoring them."""

from typing import Any, Dict, Optional

import tensorflow as tf

from expframe.data_position import DataPosition
from expframe.errors import ConfigError


class Checkpointer:
    """Saves and restores a run: its step, the task's trackables (models, optimizers,
    ...) and this worker's data position.

    Args:
      replicator: the run's Replicator.
      step: the trainer's step variable.
      trackables: the task's objects to checkpoint (`Task.trackables()`).
      data_position: this worker's DataPosition.
      max_to_keep: how many recent checkpoints to keep.
    """

    def __init__(self, replicator, step: tf.Variable, trackables: Dict[str, Any],
                 data_position: DataPosition, max_to_keep: int):
        self._rep = replicator
        self.step = step
        self.data_position = data_position
        self.max_to_keep = max_to_keep
        self.checkpoint = tf.train.Checkpoint(step=step, **data_position.in_checkpoint(), **trackables)
        self.manager = None
        self._shared_dir = None

    def restore(self, checkpoint_dir: str, read_dir: Optional[str] = None) -> int:
        """Restores the newest readable checkpoint; returns its step (0 if none).

        Checkpoints are written to `checkpoint_dir` and read from `read_dir` (default
        the same): on a multi-worker cluster every worker resumes from the chief's.

        TensorFlow writes a checkpoint's data files first and then atomically
        rewrites the `checkpoint` index, so a crash mid-save leaves the previous
        checkpoint as the latest. Should the newest still be unreadable, older ones
        are tried in turn.
        """
        self.manager = tf.train.CheckpointManager(self.checkpoint, checkpoint_dir, max_to_keep=self.max_to_keep)
        self._shared_dir = read_dir or checkpoint_dir
        readable = self.manager.checkpoints
        if read_dir and read_dir != checkpoint_dir:
            state = tf.train.get_checkpoint_state(read_dir)
            readable = list(state.all_model_checkpoint_paths) if state else []
        for path in reversed(readable):
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
            except (tf.errors.OpError, ValueError, AssertionError) as e:
                if "not found in checkpoint" in str(e) or "Unresolved object" in str(e):
                    raise ConfigError(
                        f"the checkpoint {path} does not match this experiment's model "
                        "(use a new --model_dir, or the config it was written with).") from None
                print(f"expframe: could not read {path} ({type(e).__name__}); trying an older checkpoint", flush=True)
                continue
            step = int(self.step.numpy())
            self.data_position.restore(self._shared_dir, step)
            return step
        return 0

    def save(self) -> str:
        """Writes a checkpoint at the current step (this worker's data position first)."""
        step = int(self.step.numpy())
        self.data_position.save(self._shared_dir, step)
        return self.manager.save(checkpoint_number=step)
