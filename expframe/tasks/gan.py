"""Class-conditional GAN training (SN-GAN): two players, one train step, FID/IS at eval.

One train step (replica context, single-device-looking code):
  * `disc_steps` discriminator updates, each on its own sub-batch of real images
    and fakes generated from the element's noise and fake labels; real and fake
    go through the discriminator as one batch (it has no batch norm, so this is
    the same as two calls, and does one spectral-norm power iteration per update);
  * one generator update on fresh noise, against the discriminator just trained
    (called with training=False: its spectral-norm vectors are not advanced), on
    `generator_batch_ratio` x the discriminator's global batch (the official
    ImageNet code draws 2x: `n_gen_samples`);
  * optionally, an exponential moving average of the generator's weights
    (`ema_decay`; its batch-norm statistics and spectral-norm vectors are copied),
    which then makes the samples, the grids and the metrics.
Losses: hinge (Miyato et al.; default) or non-saturating (Goodfellow et al.).
Each network has its own wrapped optimizer (Adam with beta1 0, beta2 0.9 unless
bound: `GANTask.generator_optimizer = @generator/keras.optimizers.Adam`); gradients
are averaged over replicas by `wrap_optimizer`, batch-norm moments over the global
batch by `SyncBatchNorm`; noise and labels come from the input pipeline, drawn per
global step (expframe/tasks/gan_inputs.py). So 1 and N replicas take the same
update on the same global batch.

Standing statistics of the moving average. The copied batch-norm statistics
describe the activations of the online generator's weights, not of the averaged
ones. With `ema_standing_passes` K > 0, before each evaluation (and so for its
grid) the task re-estimates them (BigGAN's "standing statistics"): K training-mode
passes of the averaged generator on the generator's global batch of noise and uniform labels
(drawn from stateless seeds of `eval_seed`: the same at every evaluation, on any
replica count), batch norm synchronised over replicas as in training; each batch
norm's moving mean and variance become the mean over the passes of its global-batch
mean and (biased) variance. They are used for the evaluation's samples only: the
copied statistics are put back after it, so checkpoints and training do not see
them. `ema_standing_passes = 0` (the default) samples with the copied statistics:
on `sngan_shapes` standing statistics (16 passes) gave a worse FID and sample
accuracy at the final step than the copied ones (docs/sngan.md;
benchmarks/sngan_standing_stats.py).

Evaluation (`evaluate`): `num_eval_samples` images from the sampling generator
(noise seeded per sample, labels balanced over the classes) and as many real ones
from `metric_split`, through the feature network on every replica
(expframe/metrics/pipeline.py): `fid`, `inception_score` (and its std over
splits), and for a network that knows the data's classes, `sample_accuracy` (the
fraction of samples it classifies as the class they were drawn for).
`Trainer.eval_steps` does not apply. `write_outputs` (chief) writes
`samples/step_<N>.png`, one row per class (up to `grid_classes` rows), and the
same grid to TensorBoard under `eval/`.
"""

import os
import tempfile
from typing import Any, Callable, Dict, Optional

import gin
import keras
import numpy as np
import PIL.Image
import tensorflow as tf

import expframe as xf
from expframe.metrics.feature_networks import FeatureNetwork
from expframe.metrics.pipeline import ReplicatedFeatures, sample_scores
from expframe.metrics.scores import statistics
from expframe.schedules import updates_per_step
from expframe.tasks import gan_inputs, gan_standing
from expframe.tasks.base import Task, model_losses

LOSSES = ("hinge", "non_saturating")


def default_adam() -> keras.optimizers.Optimizer:
    """Adam(2e-4, beta1=0, beta2=0.9): the SN-GAN setting."""
    return keras.optimizers.Adam(2e-4, beta_1=0.0, beta_2=0.9)


def discriminator_loss(kind: str, real: tf.Tensor, fake: tf.Tensor) -> tf.Tensor:
    if kind == "hinge":
        return tf.reduce_mean(tf.nn.relu(1.0 - real)) + tf.reduce_mean(tf.nn.relu(1.0 + fake))
    return tf.reduce_mean(tf.nn.softplus(-real)) + tf.reduce_mean(tf.nn.softplus(fake))


def generator_loss(kind: str, fake: tf.Tensor) -> tf.Tensor:
    if kind == "hinge":
        return -tf.reduce_mean(fake)
    return tf.reduce_mean(tf.nn.softplus(-fake))


def generator_batch(ratio: float, global_batch_size: int, num_replicas: int) -> int:
    """The generator's global batch: ratio x the discriminator's, checked to be a whole
    number of examples divisible by the replicas (ConfigError otherwise)."""
    examples = ratio * global_batch_size
    if examples != int(examples) or int(examples) % num_replicas:
        raise xf.ConfigError(
            f"GANTask.generator_batch_ratio={ratio!r} x Trainer.global_batch_size={global_batch_size} = "
            f"{examples:g} generator examples per update, not a whole number divisible by the {num_replicas} "
            "replicas; change either binding.")
    return int(examples)


@gin.configurable
class GANTask(Task):
    """Trains a class-conditional generator against a discriminator (see module docstring).

    Args:
      generator: `fn(image_size, num_classes) -> keras.Model` [z, labels] -> images in
        [-1, 1] (e.g. `@sngan_generator`).
      discriminator: `fn(image_size, num_classes) -> keras.Model` [images, labels] ->
        scores [B] (e.g. `@sngan_discriminator`). Each network's regularisation losses
        (`model.losses`, e.g. `kernel_regularizer=...`) are added to its own loss, and
        logged as `d_reg_loss` and `g_reg_loss` when it has some.
      dataset: the dataset contract of `ClassificationTask.dataset`, images in [-1, 1]
        (e.g. `@shapes_input` with `shapes_input.standardize = False`, `@gan_imagenet_input`).
      image_size: side of the images.
      num_classes: labels.
      generator_optimizer, discriminator_optimizer: build the Keras optimizers
        (None: Adam(2e-4, beta1=0, beta2=0.9)); bind with gin scopes `generator/` and
        `discriminator/`.
      disc_steps: discriminator updates per generator update (per train step).
      generator_batch_ratio: the generator's global batch per update as a multiple of
        the discriminator's (`Trainer.global_batch_size`); the product must be a whole
        number divisible by the replicas. 1: the same batch; the official SN-GAN
        ImageNet code uses 2 (`n_gen_samples` 32 against `batchsize` 16 per GPU).
      loss: 'hinge' or 'non_saturating'.
      ema_decay: decay of the moving average of the generator's weights (None: off).
      ema_start_step: before this many generator updates the average copies the weights.
      ema_standing_passes: training-mode passes of the averaged generator, each on the
        generator's global batch, that re-estimate its batch-norm statistics before
        each evaluation (see module docstring); 0 (the default): sample with the
        statistics copied from the online generator.
      feature_network: `fn() -> FeatureNetwork` for the metrics (e.g. `@shapes_classifier`,
        `@inception_network`); None: no metrics (grids only).
      num_eval_samples: N generated and N real images per evaluation.
      inception_splits: splits of the Inception Score.
      train_split, metric_split: dataset splits for training and for the real statistics.
      grid_columns, grid_classes: samples per row and rows (classes) of the grids.
      eval_seed: seed of the evaluation noise (the same samples at every evaluation).
    """

    def __init__(self, generator: Callable[..., keras.Model] = gin.REQUIRED,
                 discriminator: Callable[..., keras.Model] = gin.REQUIRED,
                 dataset: Callable[..., tf.data.Dataset] = gin.REQUIRED,
                 image_size: int = gin.REQUIRED, num_classes: int = gin.REQUIRED,
                 generator_optimizer: Optional[Callable[[], keras.optimizers.Optimizer]] = None,
                 discriminator_optimizer: Optional[Callable[[], keras.optimizers.Optimizer]] = None,
                 disc_steps: int = 5, generator_batch_ratio: float = 1, loss: str = "hinge",
                 ema_decay: Optional[float] = None, ema_start_step: int = 0, ema_standing_passes: int = 0,
                 feature_network: Optional[Callable[[], FeatureNetwork]] = None,
                 num_eval_samples: int = 10_000, inception_splits: int = 10, train_split: str = "train",
                 metric_split: str = "train", grid_columns: int = 10, grid_classes: int = 10, eval_seed: int = 1234):
        for name, value in (("disc_steps", disc_steps), ("image_size", image_size), ("num_classes", num_classes),
                            ("num_eval_samples", num_eval_samples), ("inception_splits", inception_splits),
                            ("grid_columns", grid_columns), ("grid_classes", grid_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise xf.ConfigError(f"GANTask.{name}={value!r} must be a positive integer.")
        if isinstance(ema_standing_passes, bool) or not isinstance(ema_standing_passes, int) \
                or ema_standing_passes < 0:
            raise xf.ConfigError(f"GANTask.ema_standing_passes={ema_standing_passes!r} must be an integer >= 0 "
                                 "(0: sample with the copied batch-norm statistics).")
        if isinstance(generator_batch_ratio, bool) or not isinstance(generator_batch_ratio, (int, float)) \
                or not generator_batch_ratio > 0:
            raise xf.ConfigError(f"GANTask.generator_batch_ratio={generator_batch_ratio!r} must be a number > 0.")
        if loss not in LOSSES:
            raise xf.ConfigError(f"GANTask.loss={loss!r}: use one of {', '.join(LOSSES)}.")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise xf.ConfigError(f"GANTask.ema_decay={ema_decay!r} must be in (0, 1), or None for no average.")
        self._generator_fn, self._discriminator_fn, self._dataset_fn = generator, discriminator, dataset
        self._generator_opt_fn = generator_optimizer or default_adam
        self._discriminator_opt_fn = discriminator_optimizer or default_adam
        self._feature_fn = feature_network
        self.image_size, self.num_classes, self.disc_steps, self.loss = image_size, num_classes, disc_steps, loss
        self.ema_decay, self.ema_start_step, self.ema_standing_passes = ema_decay, ema_start_step, ema_standing_passes
        self.generator_batch_ratio = generator_batch_ratio
        self.num_eval_samples, self.inception_splits, self.eval_seed = num_eval_samples, inception_splits, eval_seed
        self.train_split, self.metric_split = train_split, metric_split
        self.grid_columns, self.grid_classes = grid_columns, grid_classes
        self._real_stats = None
        self._features = None
        self._summary_writer = None
        self._standing = None       # (generator updates, [(variable, standing value)]) of the last evaluation
        self._standing_estimator = None

    # -- set-up --------------------------------------------------------------------------

    def setup(self, replicator, global_batch_size: int, seed: int, deterministic: bool) -> None:
        super().setup(replicator, global_batch_size, seed, deterministic)
        self.examples_per_step = global_batch_size * self.disc_steps  # real images per step
        self.generator_batch_size = generator_batch(self.generator_batch_ratio, global_batch_size,
                                                    replicator.num_replicas)
        self.feature_network = self._feature_fn() if self._feature_fn else None
        net = self.feature_network
        if net is not None and getattr(net, "image_size", self.image_size) != self.image_size:
            raise xf.ConfigError(f"{net.name}.image_size={net.image_size} differs from GANTask.image_size="
                                 f"{self.image_size}; bind both to the same size.")
        if net is not None and hasattr(net, "cached") and not net.cached and replicator.num_workers > 1:
            raise xf.ConfigError(
                f"the {net.name} for FID is not cached in {net.directory}; on several workers train it once "
                "first: python -m expframe.metrics (same --data_dir and --image_size).")

    def build(self) -> None:
        self.generator = self._generator_fn(image_size=self.image_size, num_classes=self.num_classes)
        self.discriminator = self._discriminator_fn(image_size=self.image_size, num_classes=self.num_classes)
        self.z_dim = int(self.generator.inputs[0].shape[-1])
        got = tuple(self.generator.output_shape[1:])
        if got != (self.image_size, self.image_size, 3):
            raise xf.ConfigError(f"GANTask.generator makes images of shape {got}, not "
                                 f"({self.image_size}, {self.image_size}, 3) (GANTask.image_size).")
        # A schedule that counts steps (ConstantThenLinearDecay) takes each player's
        # updates per train step: the generator 1, the discriminator disc_steps.
        with updates_per_step(1):
            generator_optimizer = self._generator_opt_fn()
        self.generator_optimizer = xf.wrap_optimizer(generator_optimizer)
        self.generator_optimizer.build(self.generator.trainable_variables)
        with updates_per_step(self.disc_steps):
            discriminator_optimizer = self._discriminator_opt_fn()
        self.discriminator_optimizer = xf.wrap_optimizer(discriminator_optimizer)
        self.discriminator_optimizer.build(self.discriminator.trainable_variables)
        self.generator_ema = None
        if self.ema_decay is not None:
            self.generator_ema = self._generator_fn(image_size=self.image_size, num_classes=self.num_classes)
            for e, v in zip(self.generator_ema.weights, self.generator.weights, strict=True):
                e.assign(v)

    @property
    def sampler(self) -> keras.Model:
        """The generator that makes samples: the moving average if there is one."""
        return self.generator_ema if self.generator_ema is not None else self.generator

    @property
    def standing_statistics(self) -> Optional[Dict[str, np.ndarray]]:
        """The moving average's standing batch-norm statistics estimated by the last
        evaluation, by variable path (None: none estimated, see `ema_standing_passes`)."""
        return None if self._standing is None else {v.path: value for v, value in self._standing[1]}

    def trackables(self) -> Dict[str, Any]:
        out = {"generator": self.generator, "discriminator": self.discriminator,
               "generator_optimizer": self.generator_optimizer,
               "discriminator_optimizer": self.discriminator_optimizer}
        if self.generator_ema is not None:
            out["generator_ema"] = self.generator_ema
        return out

    # -- training ------------------------------------------------------------------------

    def _check_images(self, dataset):
        shape = tuple(dataset.element_spec["image"].shape[1:])
        if shape != (self.image_size, self.image_size, 3):
            raise xf.ConfigError(f"GANTask.dataset gives images of shape {shape}, not ({self.image_size}, "
                                 f"{self.image_size}, 3): bind the dataset's image_size to GANTask.image_size.")
        return dataset

    def _metric_input(self, ctx, batch):
        return self._check_images(self._dataset_fn(
            split=self.metric_split, ctx=ctx, batch_size=ctx.get_per_replica_batch_size(batch), training=True,
            seed=self.eval_seed, deterministic=self.deterministic))

    def train_input_fn(self, ctx):
        def real(real_ctx, per_replica):
            return self._check_images(self._dataset_fn(
                split=self.train_split, ctx=real_ctx, batch_size=per_replica, training=True, seed=self.seed,
                deterministic=self.deterministic))
        return gan_inputs.train_elements(real, ctx, self.disc_steps, self.global_batch_size, self.z_dim,
                                         self.num_classes, self.seed, generator_batch=self.generator_batch_size)

    def _discriminator_step(self, real, labels, z, fake_labels):
        fake = self.generator([z, fake_labels], training=True)
        images = tf.concat([real, tf.cast(fake, real.dtype)], axis=0)
        with tf.GradientTape() as tape:
            scores = tf.cast(self.discriminator([images, tf.concat([labels, fake_labels], 0)], training=True),
                             tf.float32)
            d_real, d_fake = tf.split(scores, 2)
            loss = discriminator_loss(self.loss, d_real, d_fake)
            reg_loss = model_losses(self.discriminator)  # its kernel_regularizer=... terms, if any
            total = loss if reg_loss is None else loss + reg_loss
        self.discriminator_optimizer.minimize(total, self.discriminator.trainable_variables, tape)
        return loss, reg_loss, tf.reduce_mean(d_real), tf.reduce_mean(d_fake)

    def _generator_step(self, z, labels):
        with tf.GradientTape() as tape:
            fake = self.generator([z, labels], training=True)
            scores = tf.cast(self.discriminator([fake, labels], training=False), tf.float32)
            loss = generator_loss(self.loss, scores)
            reg_loss = model_losses(self.generator)
            total = loss if reg_loss is None else loss + reg_loss
        self.generator_optimizer.minimize(total, self.generator.trainable_variables, tape)
        return loss, reg_loss

    def _update_ema(self):
        # After the first update `iterations` >= 1; average from ema_start_step updates on.
        started = self.generator_optimizer.iterations > self.ema_start_step
        decay = tf.where(started, tf.constant(self.ema_decay, tf.float32), 0.0)
        for e, v in zip(self.generator_ema.weights, self.generator.weights, strict=True):
            if v.trainable:
                e.assign(decay * e + (1.0 - decay) * v)
            else:  # batch-norm statistics, spectral-norm vectors
                e.assign(v)

    # Plain graph code (no data-dependent Python control flow): AutoGraph's conversion
    # of the step would only add tracing time.
    @tf.autograph.experimental.do_not_convert
    def train_step(self, batch) -> Dict[str, tf.Tensor]:
        d = self.disc_steps
        sub = {k: tf.reshape(batch[k], [d, -1] + batch[k].shape.as_list()[1:])
               for k in ("image", "label", "fake_z", "fake_label")}  # [d * b, ...] -> [d, b, ...]
        d_losses, d_regs, d_reals, d_fakes = [], [], [], []
        for j in range(d):  # unrolled: each update syncs replicas
            loss, d_reg, d_real, d_fake = self._discriminator_step(sub["image"][j], sub["label"][j],
                                                                   sub["fake_z"][j], sub["fake_label"][j])
            d_losses.append(loss), d_regs.append(d_reg), d_reals.append(d_real), d_fakes.append(d_fake)
        g_loss, g_reg = self._generator_step(batch["gen_z"], batch["gen_label"])
        if self.generator_ema is not None:
            self._update_ema()
        d_loss = tf.add_n(d_losses) / self.disc_steps
        # "loss" (logged, NaN-guarded) is the sum of both players' losses, their models'
        # regularisation losses (`model.losses`) included, which are also shown apart.
        out = {"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss,
               "d_real": tf.add_n(d_reals) / self.disc_steps, "d_fake": tf.add_n(d_fakes) / self.disc_steps}
        if d_regs[0] is not None:
            out["d_reg_loss"] = tf.add_n(d_regs) / self.disc_steps
            out["loss"] += out["d_reg_loss"]
        if g_reg is not None:
            out["g_reg_loss"] = g_reg
            out["loss"] += g_reg
        return out

    # -- evaluation ----------------------------------------------------------------------

    def _pipeline(self) -> ReplicatedFeatures:
        if self._features is None:
            net = self.feature_network
            if hasattr(net, "prepare"):
                net.prepare()  # host side: trains and caches the shapes classifier on first use
            with self.replicator.scope():
                net.build()
            self._features = ReplicatedFeatures(self.replicator, net)
        return self._features

    def _fake_images(self, element):
        return self.sampler([element["z"], element["label"]], training=False), element["label"]

    def _estimate_standing_statistics(self) -> None:
        """Standing statistics of the moving average (module docstring), kept for the
        samples of this evaluation; runs on every replica and worker."""
        self._standing = None
        if self.generator_ema is None or not self.ema_standing_passes:
            return
        if self._standing_estimator is None:
            self._standing_estimator = gan_standing.StandingStatistics(self.replicator, self.generator_ema)
        batch, passes = self.generator_batch_size, self.ema_standing_passes
        values = self._standing_estimator.estimate(
            lambda ctx: gan_inputs.standing_inputs(ctx, passes, batch, self.z_dim, self.num_classes,
                                                   self.eval_seed), passes, batch)
        self._standing = (int(self.generator_optimizer.iterations.numpy()), values)

    def _sampling_statistics(self):
        """Context: the sampler's batch norms use the standing statistics of the last
        evaluation, if it was at the current step (else the copied ones: `evaluate` first)."""
        fresh = self._standing is not None and self._standing[0] == int(self.generator_optimizer.iterations.numpy())
        return gan_standing.applied(self._standing[1] if fresh else [])

    @staticmethod
    def _real_images(element):
        return element["image"], element["label"]

    def evaluate(self, runner) -> Optional[Dict[str, float]]:
        self._estimate_standing_statistics()  # also for the grid that write_outputs draws next
        if self.feature_network is None:
            return None
        pipeline, batch, n = self._pipeline(), runner.global_batch_size, self.num_eval_samples
        if self._real_stats is None:  # the real images do not change: once per process
            real = pipeline.collect(lambda ctx: self._metric_input(ctx, batch), self._real_images, n, batch)
            self._real_stats = statistics(real["features"])
        steps = -(-n // batch)
        with self._sampling_statistics():
            fake = pipeline.collect(
                lambda ctx: gan_inputs.sample_inputs(ctx, steps, batch, self.z_dim, self.num_classes, self.eval_seed),
                self._fake_images, n, batch)
        return sample_scores(fake, self._real_stats, self.inception_splits, self.feature_network.labels_match_data)

    # -- export --------------------------------------------------------------------------

    def _serving_copy(self, generator: keras.Model) -> tf.types.experimental.PolymorphicFunction:
        """`z` float32 [None, z_dim], `label` int32 [None] -> `image` float32 [None, S, S, 3] in
        [-1, 1], from a plain copy of `generator`'s current weights."""
        copy = self._generator_fn(image_size=self.image_size, num_classes=self.num_classes)
        copy.set_weights(generator.get_weights())

        @tf.function(input_signature=[tf.TensorSpec([None, self.z_dim], tf.float32, name="z"),
                                      tf.TensorSpec([None], tf.int32, name="label")])
        def generate(z, label):
            return {"image": tf.cast(copy([z, label], training=False), tf.float32)}
        return generate

    def serving(self) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
        """'serving_default': the generator the run samples with (`sampler`), with the
        standing batch-norm statistics when `ema_standing_passes` > 0 (estimated here, as
        an evaluation does; saved as its batch norms' statistics); 'online': the online
        generator. Both as `_serving_copy` describes."""
        self._estimate_standing_statistics()
        with self._sampling_statistics():
            sampler = self._serving_copy(self.sampler)
        return {"serving_default": sampler, "online": self._serving_copy(self.generator)}

    # -- outputs -------------------------------------------------------------------------

    def sample_grid(self) -> np.ndarray:
        """uint8 [rows * S, columns * S, 3]: row r shows class rows[r], column c the same noise
        (with the standing statistics of an evaluation at this step, if there was one)."""
        rows = np.unique(np.linspace(0, self.num_classes - 1, min(self.grid_classes, self.num_classes)).astype(int))
        z = tf.random.stateless_normal([self.grid_columns, self.z_dim], seed=[self.eval_seed + 1, 0])
        z = tf.tile(z, [len(rows), 1])
        labels = tf.constant(np.repeat(rows, self.grid_columns), tf.int32)
        with self._sampling_statistics():
            images = self.sampler([z, labels], training=False).numpy()
        s = self.image_size
        pixels = np.clip(np.round((images + 1.0) * 127.5), 0, 255).astype(np.uint8)
        return pixels.reshape(len(rows), self.grid_columns, s, s, 3).swapaxes(1, 2).reshape(
            len(rows) * s, self.grid_columns * s, 3)

    def write_outputs(self, model_dir: str, step: int) -> None:
        grid = self.sample_grid()
        folder = os.path.join(model_dir, "samples")
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=".png")
        with os.fdopen(fd, "wb") as f:
            PIL.Image.fromarray(grid).save(f, format="png")
        os.replace(tmp, os.path.join(folder, f"step_{step}.png"))
        if self._summary_writer is None:
            self._summary_writer = tf.summary.create_file_writer(os.path.join(model_dir, "eval"))
        with self._summary_writer.as_default(step=step):
            tf.summary.image("samples", grid[None], max_outputs=1)
        self._summary_writer.flush()
