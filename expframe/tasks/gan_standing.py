"""Standing batch-norm statistics of a generator (BigGAN's "standing stats").

A generator's batch norms keep moving statistics of the activations that training
produced. For a moving average of the generator's weights (`GANTask.ema_decay`)
those statistics are copied from the online generator: they describe the online
weights' activations, not the averaged weights'. Standing statistics re-estimate
them from the averaged generator itself: K training-mode passes on sampled noise
and labels, and each batch norm's statistics become

    moving_mean     = (1 / K) sum_k mean_k          mean_k, var_k: the moments of
    moving_variance = (1 / K) sum_k var_k           pass k's global batch (biased var)

A pass runs on every replica with the batch norm synchronised as in training
(`SyncBatchNorm`: moments of the global batch), so the statistics are the same on
1 or N replicas. During a pass each batch norm's momentum is 0 (its moving
statistics become exactly that batch's moments); the host reads them after each
pass and averages them in float64. Everything else a training-mode pass writes
(spectral-norm vectors, the statistics themselves) is put back afterwards:
`estimate` changes no variable. `applied(values)` puts the estimate in place for
sampling and restores the previous values after it.

    values = StandingStatistics(replicator, generator).estimate(input_fn, passes, global_batch)
    with applied(values):
        images = generator([z, labels], training=False)
"""

import contextlib
from typing import Callable, Iterator, List, Tuple

import keras
import numpy as np
import tensorflow as tf

from expframe.errors import ConfigError

Statistics = List[Tuple[tf.Variable, np.ndarray]]


def batch_norms(model: keras.Model) -> List[keras.layers.BatchNormalization]:
    """The model's batch-norm layers, nested ones included, in a fixed order."""
    # pylint: disable-next=protected-access
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization)]


class StandingStatistics:
    """Estimates the standing statistics of one model on one replicator (see module docstring).

    The replicated pass is traced once, on the first `estimate`.

    Args:
      replicator: the run's Replicator (synchronous targets).
      model: a generator [z, labels] -> images, built in the replicator's scope.
    """

    def __init__(self, replicator, model: keras.Model):
        self.replicator, self.model = replicator, model
        self.norms = batch_norms(model)
        for norm in self.norms:
            if norm.renorm:
                raise ConfigError(f"standing statistics: batch norm {norm.path} uses renorm, whose moving "
                                  "statistics are not the batch moments; set GANTask.ema_standing_passes = 0.")
        self.statistics = [v for n in self.norms for v in (n.moving_mean, n.moving_variance)]

        @tf.autograph.experimental.do_not_convert
        def one_pass(element):
            # Runs when traced: momentum 0 is baked into the graph, the layers keep theirs.
            saved = [n.momentum for n in self.norms]
            try:
                for n in self.norms:
                    n.momentum = 0.0  # moving statistics := this global batch's moments
                model([element["z"], element["label"]], training=True)
            finally:
                for n, m in zip(self.norms, saved, strict=True):
                    n.momentum = m
            return [tf.convert_to_tensor(v) for v in self.statistics]

        rep = replicator
        self._step = tf.function(lambda iterator: rep.run(one_pass, rep.next_from(iterator)))

    def estimate(self, input_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset], passes: int,
                 global_batch: int) -> Statistics:
        """Standing statistics of the model's batch norms over `passes` passes.

        Runs on every replica (and every worker): call it where all of them do.

        Args:
          input_fn: `fn(ctx)` -> per-replica elements {"z", "label"}, at least `passes`
            global batches (`gan_inputs.standing_inputs`).
          passes: K >= 1.
          global_batch: examples per pass over all replicas.

        Returns:
          [(moving statistic variable, its standing value)], for `applied`. The model's
          variables are left as they were.
        """
        rep = self.replicator
        saved = [(v, v.numpy()) for v in self.model.non_trainable_weights]  # statistics, spectral-norm vectors
        try:
            iterator = rep.distribute(input_fn, global_batch).plain_iterator()
            totals, dtypes = None, None
            for _ in range(passes):
                out = rep.local_results(self._step(iterator))[0]  # identical on every replica
                dtypes = [t.dtype.as_numpy_dtype for t in out]
                values = [np.asarray(t, np.float64) for t in out]
                totals = values if totals is None else [a + b for a, b in zip(totals, values, strict=True)]
        finally:
            for v, value in saved:
                v.assign(value)
        return [(v, (total / passes).astype(dtype))
                for v, total, dtype in zip(self.statistics, totals, dtypes, strict=True)]


@contextlib.contextmanager
def applied(values: Statistics) -> Iterator[None]:
    """Assigns the standing statistics inside the block, the previous values after it."""
    previous = [(v, v.numpy()) for v, _ in values]
    try:
        for v, value in values:
            v.assign(value)
        yield
    finally:
        for v, value in previous:
            v.assign(value)
