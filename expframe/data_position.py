"""Where the training input stands, saved with the checkpoints.

The position is the train iterator's `InputPosition` (expframe/replicator/inputs.py):
the global batches and examples the steps have consumed and the replica count that
counted them, three int64 in the run's checkpoint (key `data`), a few hundred bytes
whatever the dataset. It is the same on every worker, so the chief's checkpoint
holds it for all of them and no worker writes anything of its own.

On resume every worker rebuilds its input at that position and logs one line
saying how:

- carried over: the input_fn reads `ctx.start_example` (expframe's datasets do) and
  restarts at the consumed example, at any replica and worker count and global
  batch size, reading nothing twice;
- re-derived: an input_fn that ignores it is rebuilt from its beginning and the
  consumed batches are skipped (exact for a deterministic order at the same global
  batch size).

Before issue 9 the position was the tf.data iterator's state: its shuffle buffer
and prefetched batches, several GB per worker for ResNet-50 on ImageNet, and
unreadable at another replica count (benchmarks/data_checkpoint_size.py).
"""

from typing import Any, Dict, Optional

from expframe.replicator.inputs import DistributedIterator


class DataPosition:
    """The position of the train iterator, for the Checkpointer.

    Args:
      replicator: the run's Replicator (unused: the position is the same on every worker).
      iterator: the train `DistributedIterator`, or None when the position is not
        saved (parameter_server, or a task with `checkpoint_input = False`).
      max_to_keep: unused (the position lives in the run's own checkpoints).
    """

    def __init__(self, replicator, iterator: Optional[DistributedIterator], max_to_keep: int = 0):
        del replicator, max_to_keep
        if iterator is not None and not isinstance(iterator, DistributedIterator):
            raise TypeError(f"DataPosition takes the DistributedIterator of Replicator.distribute, "
                            f"got {type(iterator).__name__}.")
        self._iterator = iterator

    def in_checkpoint(self) -> Dict[str, Any]:
        """What goes into the run's checkpoint: the iterator's position, if saved."""
        return {} if self._iterator is None else {"data": self._iterator.position}

    def save(self, shared_dir: str, step: int) -> None:
        """Nothing to write beside the run's checkpoint."""
        del shared_dir, step

    def restore(self, shared_dir: str, step: int) -> Optional[str]:
        """After the checkpoint of `step` was restored (position included): rebuilds the
        input at the position and prints, and returns, the line saying how."""
        del shared_dir, step
        if self._iterator is None:
            return None
        line = self._iterator.restart()
        print(f"expframe: {line}", flush=True)
        return line
