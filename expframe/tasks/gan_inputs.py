"""Input for GAN tasks: train elements of `disc_steps` sub-batches with their noise,
sample noise indexed globally, noise for standing statistics, and ImageNet scaled to
[-1, 1] for a generator.

Replica-count invariance. A dataset function gives per-replica batches in which
each run of `local` consecutive batches is one global batch (replica i of a worker
takes the i-th), the same order `Replicator.distribute` hands them out. A GAN
train step consumes `disc_steps` global batches, so each replica's element must
hold the i-th per-replica batch of `disc_steps` consecutive global batches:
`train_elements` takes `disc_steps * local` consecutive batches and deals them
out. The noise and the labels of generated images are drawn in the pipeline from
stateless seeds (seed, stream, global step) for the whole global batch, each
replica keeping its own rows; so every global step sees the same real images, the
same noise and the same fake labels on 1 or N replicas. The generator's update
may take a batch of its own size (`generator_batch`, e.g. twice the discriminator's
as in the official SN-GAN ImageNet code), drawn the same way over its global batch.
"""

from typing import Callable, Optional

import gin
import tensorflow as tf

from expframe.data import imagenet

# Independent random streams of one train step, and of the standing-statistics passes
# (seeded by the evaluation seed; streams 4, 5 never meet a train stream of any seed).
_FAKE_Z, _FAKE_LABEL, _GEN_Z, _GEN_LABEL, _STANDING_Z, _STANDING_LABEL = range(6)


def _seed(seed: int, stream: int, step) -> tf.Tensor:
    return tf.stack([tf.constant(seed * 16 + stream, tf.int64), tf.cast(step, tf.int64)])


def global_rows(seed, stream, step, global_batch, first_row, rows, z_dim=None, num_classes=None):
    """Rows [first_row, first_row + rows) of the global batch's noise (z_dim) or labels."""
    s = _seed(seed, stream, step)
    if z_dim is not None:
        values = tf.random.stateless_normal([global_batch, z_dim], seed=s)
    else:
        values = tf.random.stateless_uniform([global_batch], seed=s, minval=0, maxval=num_classes, dtype=tf.int32)
    return values[first_row:first_row + rows]


class _RealContext(tf.distribute.InputContext):
    """The InputContext given to the dataset function of the real images: where the real
    stream starts (`start_example`), and whether the dataset read it."""

    def __init__(self, ctx: tf.distribute.InputContext, start_example: int):
        super().__init__(ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync)
        self._start_example = start_example
        self.start_read = False

    @property
    def start_example(self) -> int:
        self.start_read = True
        return self._start_example


def train_elements(dataset_fn: Callable[[tf.distribute.InputContext, int], tf.data.Dataset],
                   ctx: tf.distribute.InputContext, disc_steps: int, global_batch: int, z_dim: int,
                   num_classes: int, seed: int, generator_batch: Optional[int] = None) -> tf.data.Dataset:
    """Per-replica train elements of a GAN step (see module docstring).

    Resuming. Each element (one train step) holds `disc_steps * global_batch` real
    examples over all replicas, and says so (`ctx.get_per_replica_batch_size` is
    asked for that many last), so a run's data position counts real examples. The
    input starts at `ctx.start_example` (0 if the context has none): the noise at
    the step it gives, the real images at that example, by index if the dataset
    reads `start_example` (as `shapes_input` does), else by skipping the batches
    already consumed (exact for a deterministic dataset, slower).

    Args:
      dataset_fn: `fn(ctx, per_replica_batch)` -> repeated per-replica batches
        {"image", "label"}, ctx carrying the real stream's `start_example`.
      ctx: this input pipeline's InputContext.
      disc_steps: discriminator steps per element.
      global_batch: examples per sub-batch over all replicas.
      z_dim, num_classes: of the generator.
      seed: the run's seed.
      generator_batch: examples of the generator's update over all replicas (None:
        global_batch); a multiple of the replicas.

    Returns:
      Elements {"image" [d * b, H, W, 3], "label" [d * b], "fake_z" [d * b, z_dim],
      "fake_label" [d * b], "gen_z" [g, z_dim], "gen_label" [g]} (sub-batch j is
      rows j * b .. (j + 1) * b - 1; g = generator_batch per replica).
    """
    local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    b = ctx.get_per_replica_batch_size(global_batch)
    generator_batch = global_batch if generator_batch is None else generator_batch
    g = ctx.get_per_replica_batch_size(generator_batch)
    per_step = disc_steps * global_batch
    start = int(getattr(ctx, "start_example", 0))
    first_step = start // per_step
    real_ctx = _RealContext(ctx, first_step * per_step)
    real = dataset_fn(real_ctx, b)
    if first_step and not real_ctx.start_read:  # re-derive: skip what the steps consumed
        real = real.skip(first_step * disc_steps * local)
    real = real.map(lambda ex: dict(ex, label=tf.cast(ex["label"], tf.int32)))
    real = real.batch(disc_steps * local, drop_remainder=True)

    def deal(group):  # [d * local, b, ...] -> local elements [d * b, ...], replica order
        def one(t):
            rest = t.shape.as_list()[2:]
            t = tf.reshape(t, [disc_steps, local, b] + rest)
            t = tf.transpose(t, [1, 0] + list(range(2, t.shape.rank)))
            return tf.reshape(t, [local, disc_steps * b] + rest)
        return tf.nest.map_structure(one, group)

    real = real.map(deal).unbatch()

    def add_noise(example, k):
        element, replica = k // local, k % local
        replica_index = ctx.input_pipeline_id * local + tf.cast(replica, tf.int32)
        first, first_gen = replica_index * b, replica_index * g
        steps = [element * disc_steps + j for j in range(disc_steps)]
        out = dict(example)
        out["fake_z"] = tf.concat([global_rows(seed, _FAKE_Z, t, global_batch, first, b, z_dim=z_dim)
                                   for t in steps], axis=0)
        out["fake_label"] = tf.concat([global_rows(seed, _FAKE_LABEL, t, global_batch, first, b,
                                                   num_classes=num_classes) for t in steps], axis=0)
        out["gen_z"] = global_rows(seed, _GEN_Z, element, generator_batch, first_gen, g, z_dim=z_dim)
        out["gen_label"] = global_rows(seed, _GEN_LABEL, element, generator_batch, first_gen, g,
                                       num_classes=num_classes)
        return out

    elements = tf.data.Dataset.zip(real, tf.data.Dataset.counter(first_step * local))
    # Declares the real examples per element (the data position counts them).
    ctx.get_per_replica_batch_size(per_step)
    return elements.map(add_noise, num_parallel_calls=tf.data.AUTOTUNE)


def sample_inputs(ctx: tf.distribute.InputContext, num_global_batches: int, global_batch: int, z_dim: int,
                  num_classes: int, seed: int) -> tf.data.Dataset:
    """Per-replica {"z", "label"} of samples 0 .. num_global_batches * global_batch - 1.

    Sample i has noise drawn from the stateless seed (seed, i) and label
    i % num_classes (balanced classes), so the samples do not depend on the replica
    count or the batch size.
    """
    local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    b = global_batch // ctx.num_replicas_in_sync

    def element(k):
        batch, replica = k // local, k % local
        first = batch * global_batch + (ctx.input_pipeline_id * local + replica) * b
        index = first + tf.range(b, dtype=tf.int64)
        z = tf.map_fn(lambda i: tf.random.stateless_normal([z_dim], seed=tf.stack([tf.constant(seed, tf.int64), i])),
                      index, fn_output_signature=tf.float32)
        return {"z": z, "label": tf.cast(index % num_classes, tf.int32)}

    return tf.data.Dataset.range(num_global_batches * local).map(element, num_parallel_calls=tf.data.AUTOTUNE)


def standing_inputs(ctx: tf.distribute.InputContext, num_passes: int, global_batch: int, z_dim: int,
                    num_classes: int, seed: int) -> tf.data.Dataset:
    """Per-replica {"z", "label"} of `num_passes` global batches for standing statistics.

    Pass p draws the noise and uniform labels of its whole global batch from the
    stateless seeds (seed, stream, p), each replica keeping its rows: the same
    global batches on 1 or N replicas, and at every evaluation.
    """
    local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    b = ctx.get_per_replica_batch_size(global_batch)

    def element(k):
        p, replica = k // local, k % local
        first = (ctx.input_pipeline_id * local + tf.cast(replica, tf.int32)) * b
        return {"z": global_rows(seed, _STANDING_Z, p, global_batch, first, b, z_dim=z_dim),
                "label": global_rows(seed, _STANDING_LABEL, p, global_batch, first, b, num_classes=num_classes)}

    return tf.data.Dataset.range(num_passes * local).map(element)


@gin.configurable
def gan_imagenet_input(split: str, ctx: tf.distribute.InputContext, batch_size: int, training: bool,
                       seed: int = 0, deterministic: bool = False,
                       shuffle_buffer_size: int = 10_000) -> tf.data.Dataset:
    """ImageNet for a generator: `imagenet_input`'s centre crop, scaled to [-1, 1].

    A GAN learns the distribution of the images it is shown, so it trains on the
    deterministic centre crops (`imagenet_input` with training=False: short side
    resized to image_size / 0.875, centre crop), not on random-resized crops; for
    training they are shuffled (as uint8, `shuffle_buffer_size` images) and
    repeated. Bind `imagenet_input.image_size` (and data_dir, use_mock, ...) there.

    Returns:
      {"image": float32 [batch_size, S, S, 3] in [-1, 1], "label": int32 [batch_size]}.
    """
    pipeline_seed = seed + ctx.input_pipeline_id
    ds = imagenet.imagenet_input(split, ctx, batch_size=batch_size, training=False, seed=pipeline_seed,
                                 deterministic=deterministic).unbatch()
    mean, std = tf.constant(imagenet.MEAN_RGB), tf.constant(imagenet.STDDEV_RGB)
    # Undo the classifier normalisation: back to [0, 255] (kept as uint8 while shuffled).
    ds = ds.map(lambda ex: {"image": tf.cast(tf.clip_by_value(tf.round(tf.cast(ex["image"], tf.float32) * std + mean),
                                                                0, 255), tf.uint8),
                            "label": ex["label"]})
    if training:
        ds = ds.shuffle(shuffle_buffer_size, seed=pipeline_seed, reshuffle_each_iteration=True).repeat()
    ds = ds.map(lambda ex: {"image": tf.cast(ex["image"], tf.float32) / 127.5 - 1.0, "label": ex["label"]})
    return ds.batch(batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)


