"""Evaluation batches that cover a split exactly: re-batched, masked, padded.

A global batch rarely divides an eval split (ImageNet: 50,000 images at batch 1024),
and with several replicas every replica must step the same number of times. So the
trainer re-batches the task's eval data to the per-replica batch size and adds a
"mask" feature: 1.0 for real examples, 0.0 for the zero padding that fills the last
batches. Tasks weight their eval sums and count by it (see expframe/tasks/base.py),
and every example of the split counts exactly once.
"""

import tensorflow as tf

MASK = "mask"


def masked_batches(dataset: tf.data.Dataset, batch_size: int, full_pass: bool) -> tf.data.Dataset:
    """Batches of `batch_size` examples of `dataset` (itself batched), each with MASK.

    Args:
      dataset: a dataset of dict batches (any batch sizes, e.g. a partial last one).
      batch_size: examples per output batch.
      full_pass: True: one pass over `dataset`, then padding batches forever (the
        caller stops once a step has no real example). False: `dataset` repeated.

    Raises:
      TypeError: elements are not dicts.
    """
    if not isinstance(dataset.element_spec, dict):
        raise TypeError("evaluation data must be batches of dicts (feature name -> tensor) so that "
                        f"a '{MASK}' feature can be added; got {dataset.element_spec}.")
    if MASK in dataset.element_spec:
        raise TypeError(f"evaluation data already has a '{MASK}' feature; rename it.")
    examples = dataset.unbatch().map(lambda ex: {**ex, MASK: tf.constant(1.0)})
    if full_pass:
        examples = examples.concatenate(_padding(examples).repeat())
    else:
        examples = examples.repeat()
    return examples.batch(batch_size, drop_remainder=True)


def _padding(examples: tf.data.Dataset) -> tf.data.Dataset:
    """One all-zero example with MASK 0, shaped like `examples`' elements."""
    spec = examples.element_spec
    if all(s.shape.is_fully_defined() for s in spec.values()):
        return tf.data.Dataset.from_tensors({k: tf.zeros(s.shape, s.dtype) for k, s in spec.items()})
    return examples.take(1).map(lambda ex: {k: tf.zeros_like(v) for k, v in ex.items()})
