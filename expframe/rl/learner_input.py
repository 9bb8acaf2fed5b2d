"""Replay samples as a `tf.data` input: batches prepared on the host, read in order.

The learner reads its batches through the same input path as every task
(`Replicator.distribute(input_fn)`), but what it should read is only known on the
host, just before each host call of train steps (after acting, from the replay's
current priorities). So the host prepares exactly the batches the next steps will
read and puts them into a TensorFlow FIFO queue; the dataset dequeues one element
at a time.

Why a queue and not `Dataset.from_generator`: the input pipeline prefetches. A
prefetch that asks for an element not prepared yet blocks inside the dequeue,
which TensorFlow can cancel when the iterator goes away; a Python generator blocked
waiting for data cannot be cancelled, and the iterator's destructor would wait for
it forever. And the prefetch can never read a batch early, because the host puts a
batch in only once its content is final.

Lifetime (measured on TF 2.21): an iterator whose function dequeued from an eager
queue segfaults when it is destroyed after the queue's Python object, unless the
queue was closed first. The trainer, not the task, owns the iterator, so either
may go first. Hence every queue made here stays referenced by this module until it
is closed. A collected PreparedBatches only marks its queue; the close itself (a
TensorFlow op) runs at the next safe point on the host (a new PreparedBatches, a
`put`) or at interpreter exit, never inside a finalizer, which may run anywhere,
even while a step is being traced.
"""

import atexit
import threading
from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

_open_queues = []          # queues not yet closed; see "Lifetime" above
_to_close = []             # of those, the ones whose PreparedBatches is gone
_lock = threading.RLock()  # RLock: __del__ may run inside a GC triggered while it is held


def _close(queues) -> None:
    for queue in queues:
        try:
            with tf.init_scope():
                queue.close(cancel_pending_enqueues=True)
        except Exception:  # pylint: disable=broad-except  # already gone at shutdown: nothing to guard
            pass


def _close_released() -> None:
    """Closes the queues of collected PreparedBatches, then lets them go."""
    with _lock:
        queues, _to_close[:] = list(_to_close), []
    _close(queues)
    with _lock:
        _open_queues[:] = [q for q in _open_queues if not any(q is c for c in queues)]


@atexit.register
def _close_all() -> None:
    with _lock:
        queues, _open_queues[:], _to_close[:] = list(_open_queues), [], []
    _close(queues)


class PreparedBatches:
    """A FIFO of batches (dicts of arrays of fixed shapes) and a dataset that reads it.

    Example:
      batches = PreparedBatches({"x": ((32, 5), tf.float32), "key": ((32,), tf.int64)})
      dataset = batches.dataset()               # endless; each element is one batch
      batches.put({"x": x[None], "key": k[None]})   # arrays with a leading count axis

    Args:
      specs: name -> (shape of one element, dtype).
    """

    def __init__(self, specs: Dict[str, Tuple[Tuple[int, ...], tf.DType]]):
        self.names = tuple(sorted(specs))
        self.specs = {name: (tuple(specs[name][0]), tf.as_dtype(specs[name][1])) for name in self.names}
        with tf.init_scope(), tf.device("/cpu:0"):
            # capacity -1: unbounded, so `put` never blocks the host.
            self._queue = tf.queue.FIFOQueue(
                -1, [self.specs[n][1] for n in self.names], shapes=[self.specs[n][0] for n in self.names],
                names=list(self.names), name="prepared_batches")
        _close_released()
        with _lock:
            _open_queues.append(self._queue)

    def __del__(self):
        # No TensorFlow op here (see "Lifetime" in the module docstring): only mark it.
        queue = getattr(self, "_queue", None)
        if queue is not None:
            with _lock:
                _to_close.append(queue)

    def put(self, batches: Dict[str, np.ndarray]) -> None:
        """Appends elements; each array has a leading axis over the elements."""
        if set(batches) != set(self.names):
            raise ValueError(f"PreparedBatches.put needs {self.names}, got {sorted(batches)}.")
        _close_released()
        with tf.device("/cpu:0"):
            self._queue.enqueue_many({n: np.asarray(batches[n], self.specs[n][1].as_numpy_dtype)
                                      for n in self.names})

    def size(self) -> int:
        """Elements prepared and not yet read (by the dataset or its prefetch)."""
        return int(self._queue.size())

    def dataset(self) -> tf.data.Dataset:
        """Endless dataset of the prepared elements, in the order they were put."""
        queue = self._queue
        dataset = tf.data.Dataset.from_tensors(0).repeat().map(lambda _: queue.dequeue())
        options = tf.data.Options()
        # One dequeue at a time, in order: a parallelised map could hand the elements
        # out of order.
        options.experimental_optimization.map_parallelization = False
        options.deterministic = True
        return dataset.with_options(options)
