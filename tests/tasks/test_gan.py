"""GANTask: the same global sub-batches and noise on any replica count, the same weights
after training on 1 and 2 replicas (deterministic mode; batch-norm statistics,
spectral-norm vectors and the moving average included; the generator on a batch
twice the discriminator's), the same metrics, and grids; the moving average's
standing batch-norm statistics against batch moments computed by hand."""

import functools
import os
from unittest import mock

import numpy as np
import PIL.Image
import tensorflow as tf
from absl.testing import parameterized
from tensorflow.python.framework import config as tf_config

from expframe.errors import ConfigError
from expframe.layers.sync_batch_norm import SyncBatchNorm
from expframe.metrics.feature_networks import FeatureNetwork
from expframe.models import sngan
from expframe.tasks import gan, gan_inputs
from tests import support

SIZE, CLASSES, Z = 32, 3, 8
GLOBAL_BATCH, DISC_STEPS = 8, 2
GEN_RATIO, STANDING_PASSES = 2, 4  # the generator's batch: 16


IMAGES = np.random.default_rng(0).uniform(-1, 1, size=(64, SIZE, SIZE, 3)).astype(np.float32)


def fake_images(split, ctx, batch_size, training, seed=0, deterministic=False, index_based=True):
    """The dataset contract on 64 fixed random images in [-1, 1]; training: example
    (p * 37 + seed) % 64 at global position p, from `ctx.start_example` if index_based."""
    del split, deterministic
    if not training:
        ds = tf.data.Dataset.from_tensor_slices(np.arange(64))
    else:
        start = getattr(ctx, "start_example", 0) if index_based else 0
        ds = tf.data.Dataset.counter(start + ctx.input_pipeline_id, ctx.num_input_pipelines)
        ds = ds.map(lambda p: (p * 37 + seed) % 64)
    ds = ds.map(lambda i: {"image": tf.gather(IMAGES, i), "label": tf.cast(i % CLASSES, tf.int32), "id": i})
    return ds.batch(batch_size, drop_remainder=training)


class _Context(tf.distribute.InputContext):
    def __init__(self, replicas, start_example):
        super().__init__(1, 0, replicas)
        self.start_example = start_example
        self.asked = []

    def get_per_replica_batch_size(self, global_batch_size):
        self.asked.append(global_batch_size)
        return super().get_per_replica_batch_size(global_batch_size)


def _global_steps(replicas, steps, start_example=0, index_based=True, generator_batch=None):
    """The global view of `steps` train steps: per key, the replicas' rows joined."""
    ctx = _Context(replicas, start_example)
    make = lambda c, b: fake_images("train", c, b, True, seed=3, index_based=index_based)  # noqa: E731
    elements = list(gan_inputs.train_elements(make, ctx, DISC_STEPS, GLOBAL_BATCH, Z, CLASSES, seed=3,
                                              generator_batch=generator_batch)
                    .take(steps * replicas).as_numpy_iterator())
    out = []
    for s in range(steps):  # replica r takes the r-th of each run of `replicas` elements
        group = elements[s * replicas:(s + 1) * replicas]
        joined = {}
        for key in group[0]:
            if key.startswith("gen"):
                joined[key] = np.concatenate([e[key] for e in group])
            else:  # [d * b, ...] per replica -> [d, global batch, ...]
                parts = [e[key].reshape((DISC_STEPS, -1) + e[key].shape[1:]) for e in group]
                joined[key] = np.concatenate(parts, axis=1)
        out.append(joined)
    assert ctx.asked[-1] == DISC_STEPS * GLOBAL_BATCH  # the real examples per element, asked last
    return out


class RandomProjection(FeatureNetwork):
    """A fixed random feature network (no training needed): features and logits are
    linear maps of the mean-pooled 4x4 image."""

    name, num_classes, labels_match_data = "projection", CLASSES, True

    def __init__(self):
        rng = np.random.default_rng(5)
        self.w1 = tf.constant(rng.normal(size=(48, 6)).astype(np.float32))
        self.w2 = tf.constant(rng.normal(size=(6, CLASSES)).astype(np.float32))

    def __call__(self, images):
        pooled = tf.reshape(tf.nn.avg_pool2d(tf.cast(images, tf.float32), 8, 8, "VALID"), [-1, 48])
        features = tf.nn.relu(pooled @ self.w1)
        return features, features @ self.w2


def make_task(**kwargs):
    args = dict(generator=functools.partial(sngan.sngan_generator, ch=2, z_dim=Z, widths=(2, 2, 1, 1)),
                discriminator=functools.partial(sngan.sngan_discriminator, ch=1), dataset=fake_images,
                image_size=SIZE, num_classes=CLASSES, disc_steps=DISC_STEPS, ema_decay=0.5,
                generator_batch_ratio=GEN_RATIO, ema_standing_passes=STANDING_PASSES,
                feature_network=RandomProjection, num_eval_samples=12, inception_splits=2, grid_columns=4)
    args.update(kwargs)
    return gan.GANTask(**args)


class Runner:
    global_batch_size, eval_steps = GLOBAL_BATCH, None


def train(n, steps=3):
    rep = support.replicator("cpu", n)
    tf.keras.utils.set_random_seed(0)
    task = make_task()
    task.setup(rep, GLOBAL_BATCH, seed=0, deterministic=True)
    with rep.scope():
        task.build()
    iterator = rep.distribute(task.train_input_fn, GLOBAL_BATCH).plain_iterator()
    step = tf.function(lambda it: rep.reduce(rep.run(task.train_step, rep.next_from(it)), "mean"))
    losses = [{k: float(v) for k, v in step(iterator).items()} for _ in range(steps)]
    return rep, task, losses


def weights(rep, task, check_replicas):
    """name -> value of every variable that training changes (both networks, the average,
    both optimizers); each the same on every replica."""
    out = {}
    for key, obj in task.trackables().items():
        # Model weights by path; optimizer variables by position (their paths carry a counter).
        named = ([(v.path, v) for v in obj.weights] if hasattr(obj, "weights")
                 else [(f"{i}", v) for i, v in enumerate(obj.optimizer.variables)])
        for name, v in named:
            values = [np.asarray(t) for t in rep.local_results(getattr(v, "value", v))]
            for other in values[1:]:
                np.testing.assert_array_equal(other, values[0], err_msg=f"{key}/{name} differs across replicas")
            check_replicas.append(name)
            out[f"{key}/{name}"] = values[0]
    return out


@functools.lru_cache(maxsize=None)
def trained_on_one_and_two_replicas():
    """(rep, task, losses) after 3 deterministic steps on 1, then on 2 replicas (shared by
    the tests below: training twice is their cost)."""
    tf.config.experimental.enable_op_determinism()
    try:
        return train(1), train(2)
    finally:
        tf_config.disable_op_determinism()


def moments_by_hand(task):
    """Per batch-norm statistic of the moving average: the mean over the standing passes
    of the global batch's mean and (biased) variance of that norm's input, computed with
    NumPy from the inputs, in a one-device copy of the moving average."""
    copy = task._generator_fn(image_size=SIZE, num_classes=CLASSES)  # pylint: disable=protected-access
    copy.set_weights([np.asarray(w) for w in task.generator_ema.get_weights()])
    seen, original = [], SyncBatchNorm.call

    def recording(layer, inputs, training=None, mask=None):
        if training:
            seen.append((layer.path, np.asarray(inputs, np.float64)))
        return original(layer, inputs, training=training, mask=mask)

    passes = gan_inputs.standing_inputs(tf.distribute.InputContext(), STANDING_PASSES, task.generator_batch_size,
                                        Z, CLASSES, task.eval_seed)
    sums = {}
    with mock.patch.object(SyncBatchNorm, "call", recording):
        for element in passes:
            seen.clear()
            copy([element["z"], element["label"]], training=True)
            for path, x in seen:
                for name, value in (("moving_mean", x.mean(axis=(0, 1, 2))),
                                    ("moving_variance", x.var(axis=(0, 1, 2)))):
                    sums[f"{path}/{name}"] = sums.get(f"{path}/{name}", 0.0) + value
    return {k: v / STANDING_PASSES for k, v in sums.items()}


class GANTaskTest(support.TestCase):

    @parameterized.named_parameters(*support.named_replicators())
    def test_train_elements_hold_the_same_global_batches_and_noise(self, target, n):
        del target
        want, got = _global_steps(1, 2), _global_steps(n, 2)
        for s in range(2):
            for key in want[s]:
                np.testing.assert_array_equal(got[s][key], want[s][key], err_msg=f"step {s} {key}")
        ids = np.concatenate([want[0]["id"].ravel(), want[1]["id"].ravel()])
        self.assertEqual(len(set(ids)), len(ids))  # 4 sub-batches of distinct examples
        self.assertFalse(np.array_equal(want[0]["fake_z"][0], want[0]["fake_z"][1]))
        # The generator's own batch (twice the discriminator's): its global rows on any
        # replica count; the discriminator's sub-batches unchanged.
        gen = GEN_RATIO * GLOBAL_BATCH
        want2, got2 = _global_steps(1, 2, generator_batch=gen), _global_steps(n, 2, generator_batch=gen)
        for s in range(2):
            self.assertEqual(want2[s]["gen_z"].shape, (gen, Z))
            self.assertEqual(want2[s]["gen_label"].shape, (gen,))
            for key in want2[s]:
                np.testing.assert_array_equal(got2[s][key], want2[s][key], err_msg=f"step {s} {key}")
                if not key.startswith("gen"):
                    np.testing.assert_array_equal(want2[s][key], want[s][key], err_msg=f"step {s} {key}")
        self.assertFalse(np.array_equal(want2[0]["gen_z"][:GLOBAL_BATCH], want2[0]["gen_z"][GLOBAL_BATCH:]))

    @parameterized.parameters(True, False)
    def test_train_elements_resume_at_the_position(self, index_based):
        # Steps 3, 4 of an input started at step 3 (by index, or by skipping) are those of
        # an input started at 0; the position counts disc_steps * global_batch real examples.
        whole = _global_steps(2, 5, index_based=index_based)
        resumed = _global_steps(2, 2, start_example=3 * DISC_STEPS * GLOBAL_BATCH, index_based=index_based)
        for s in range(2):
            for key in whole[3 + s]:
                np.testing.assert_array_equal(resumed[s][key], whole[3 + s][key], err_msg=f"step {s} {key}")

    def test_one_and_two_replicas_take_the_same_steps(self):
        (rep1, task1, losses1), (rep2, task2, losses2) = trained_on_one_and_two_replicas()
        self.assertEqual((task1.generator_batch_size, task2.generator_batch_size), (16, 16))
        names = []
        w1, w2 = weights(rep1, task1, []), weights(rep2, task2, names)
        self.assertEqual(w1.keys(), w2.keys())
        for key in w1:
            np.testing.assert_allclose(w2[key], w1[key], rtol=2e-5, atol=2e-5, err_msg=key)
        for a, b in zip(losses1, losses2, strict=True):
            for key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-5, err_msg=key)
        # What was compared: spectral-norm vectors, conditional batch-norm statistics, the
        # average and optimizer slots of both networks; and training moved them.
        for part in ("discriminator/block1/conv1/sn_u", "generator/block1/bn1/norm/moving_mean",
                     "generator_ema/block1/conv1/kernel", "generator_optimizer/", "discriminator_optimizer/"):
            self.assertTrue(any(part in k for k in w1), part)
        fresh = make_task()
        fresh.setup(rep1, GLOBAL_BATCH, 0, True)
        tf.keras.utils.set_random_seed(0)
        with rep1.scope():
            fresh.build()
        for key in ("discriminator/block1/conv1/sn_u", "generator/bn/moving_mean", "generator/dense/kernel"):
            start = [v for v in fresh.discriminator.weights + fresh.generator.weights if v.path in key][0]
            self.assertGreater(np.abs(w1[key] - start.numpy()).max(), 1e-6, key)
        self.assertEqual(int(task2.generator_optimizer.iterations.numpy()), 3)
        self.assertEqual(int(task2.discriminator_optimizer.iterations.numpy()), 3 * DISC_STEPS)
        # The same samples and scores on 1 and 2 replicas.
        m1, m2 = task1.evaluate(Runner()), task2.evaluate(Runner())
        self.assertEqual(set(m1), {"fid", "inception_score", "inception_score_std", "sample_accuracy"})
        for key in m1:
            self.assertAllClose(m2[key], m1[key], rtol=1e-4, atol=1e-4, msg=key)
        # Grids: one row per class, grid_columns samples each, as PNG and in TensorBoard.
        model_dir = self.get_temp_dir()
        task2.write_outputs(model_dir, 3)
        grid = np.asarray(PIL.Image.open(os.path.join(model_dir, "samples", "step_3.png")))
        self.assertEqual(grid.shape, (CLASSES * SIZE, 4 * SIZE, 3))
        np.testing.assert_allclose(grid, task1.sample_grid(), atol=1)  # up to rounding to uint8
        self.assertTrue(any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(model_dir, "eval"))))

    def test_standing_statistics_of_the_moving_average(self):
        (rep1, task1, _), (_, task2, _) = trained_on_one_and_two_replicas()
        m1, m2 = task1.evaluate(Runner()), task2.evaluate(Runner())
        standing1, standing2 = task1.standing_statistics, task2.standing_statistics
        by_hand = moments_by_hand(task1)
        self.assertEqual(set(standing1), set(by_hand))
        self.assertEqual(len(by_hand), 2 * len([w for w in task1.generator_ema.weights if "moving_mean" in w.path]))
        copied = {w.path: np.asarray(w) for w in task1.generator_ema.non_trainable_weights}
        online = {w.path: np.asarray(w) for w in task1.generator.non_trainable_weights}
        largest_change = 0.0
        for path, want in by_hand.items():
            # The mean of the passes' global-batch moments, the same on 1 and 2 replicas...
            np.testing.assert_allclose(standing1[path], want, rtol=2e-4, atol=1e-6, err_msg=path)
            np.testing.assert_allclose(standing2[path], standing1[path], rtol=1e-5, atol=1e-6, err_msg=path)
            # ...not the statistics copied from the online generator, which are back in place.
            np.testing.assert_array_equal(copied[path], online[path], err_msg=path)
            largest_change = max(largest_change, float(np.max(np.abs(standing1[path] - copied[path]))))
        self.assertGreater(largest_change, 0.05)
        # Deterministic: the same passes at every evaluation.
        task1.evaluate(Runner())
        for path, value in task1.standing_statistics.items():
            np.testing.assert_array_equal(value, standing1[path], err_msg=path)
        # The samples use them: the same on 1 and 2 replicas, different with the copied statistics.
        for key in m1:
            self.assertAllClose(m2[key], m1[key], rtol=1e-4, atol=1e-4, msg=key)
        np.testing.assert_allclose(task2.sample_grid(), task1.sample_grid(), atol=1)
        standing_grid = task1.sample_grid()
        task1.ema_standing_passes = 0
        try:
            copied_metrics = task1.evaluate(Runner())
            self.assertIsNone(task1.standing_statistics)
            self.assertGreater(np.abs(task1.sample_grid().astype(int) - standing_grid).max(), 10)
            self.assertNotAlmostEqual(copied_metrics["fid"], m1["fid"], places=3)
        finally:
            task1.ema_standing_passes = STANDING_PASSES
        self.assertIs(rep1, task1.replicator)

    def test_losses(self):
        real, fake = tf.constant([2.0, 0.5, -1.0]), tf.constant([-2.0, 0.0, 1.5])
        hinge = np.mean(np.maximum(0, 1 - real.numpy())) + np.mean(np.maximum(0, 1 + fake.numpy()))
        self.assertAllClose(gan.discriminator_loss("hinge", real, fake), hinge)
        self.assertAllClose(gan.generator_loss("hinge", fake), -np.mean(fake.numpy()))
        softplus = lambda x: np.log1p(np.exp(x))  # noqa: E731
        self.assertAllClose(gan.discriminator_loss("non_saturating", real, fake),
                            np.mean(softplus(-real.numpy())) + np.mean(softplus(fake.numpy())))
        self.assertAllClose(gan.generator_loss("non_saturating", fake), np.mean(softplus(-fake.numpy())))

    def test_bad_settings_are_config_errors(self):
        import expframe as xf  # pylint: disable=import-outside-toplevel
        for kwargs, message in (({"loss": "wasserstein"}, "GANTask.loss='wasserstein'"),
                                ({"disc_steps": 0}, "GANTask.disc_steps=0"),
                                ({"ema_decay": 1.0}, "GANTask.ema_decay=1.0"),
                                ({"ema_standing_passes": -1}, "GANTask.ema_standing_passes=-1"),
                                ({"generator_batch_ratio": 0}, "GANTask.generator_batch_ratio=0")):
            with self.assertRaisesRegex(xf.ConfigError, message):
                make_task(**kwargs)
        # The generator's batch must be whole and split evenly over the replicas.
        for ratio, replicas, message in ((0.3, 1, r"0.3 x Trainer.global_batch_size=8 = 2.4 generator examples"),
                                         (1.5, 8, r"1.5 x Trainer.global_batch_size=8 = 12 generator examples per "
                                                  r"update, not a whole number divisible by the 8 replicas")):
            with self.assertRaisesRegex(ConfigError, f"GANTask.generator_batch_ratio={message}"):
                make_task(generator_batch_ratio=ratio).setup(support.replicator("cpu", replicas), GLOBAL_BATCH, 0,
                                                             False)
        task = make_task(image_size=64, generator=functools.partial(sngan.sngan_generator, ch=1, z_dim=Z))
        task.setup(support.replicator("cpu", 1), GLOBAL_BATCH, 0, False)
        with support.replicator("cpu", 1).scope():
            task.build()
        with self.assertRaisesRegex(xf.ConfigError, r"GANTask.dataset gives images of shape \(32, 32, 3\)"):
            task.train_input_fn(tf.distribute.InputContext())
