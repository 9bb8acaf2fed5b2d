"""wrap_optimizer: N-replica training equals 1-replica training on the same global batch."""

import os

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from tests import support

GLOBAL_BATCH = 16


def _batches(steps, batch=GLOBAL_BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, 6, 6, 2)).astype(np.float32),
             rng.integers(0, 3, size=(batch,)).astype(np.int32)) for _ in range(steps)]


def _model(norm=True):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3),
        xf.layers.SyncBatchNorm(momentum=0.9) if norm else keras.layers.Identity(),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])


class Trainer:
    """A minimal replicated training loop, the way a user writes one."""

    def __init__(self, rep, accumulate_steps=1, clip=None, make_opt=None, loss_scale=None, norm=True):
        self.rep = rep
        with rep.scope():
            self.model = _model(norm)
            base = make_opt() if make_opt else keras.optimizers.SGD(0.1, momentum=0.9)
            self.opt = xf.wrap_optimizer(base, accumulate_steps=accumulate_steps,
                                         clip_global_norm=clip, loss_scale=loss_scale)

        def step(x, y):
            with tf.GradientTape() as tape:
                logits = self.model(x, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
                scaled = self.opt.scale_loss(loss)
            grads = tape.gradient(scaled, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

        self._step = tf.function(lambda x, y: rep.run(step, x, y))

    def train(self, batches):
        n = self.rep.num_replicas
        for x, y in batches:
            b = len(x) // n
            self._step(support.per_replica(self.rep, lambda r: x[r * b:(r + 1) * b]),
                       support.per_replica(self.rep, lambda r: y[r * b:(r + 1) * b]))

    def weights(self):
        for v in self.model.weights:
            values = self.rep.local_results(v.value)
            for other in values[1:]:
                np.testing.assert_array_equal(other, values[0], err_msg=f"{v.path} differs across replicas")
        return [np.asarray(self.rep.local_results(v.value)[0]) for v in self.model.weights]


class OptimizerTest(support.TestCase):

    def assertWeightsClose(self, a, b, atol=1e-5):
        self.assertEqual(len(a), len(b))
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5)

    @parameterized.named_parameters(*support.named_replicators())
    def test_replication_invariance(self, target, n):
        batches = _batches(10)
        reference = Trainer(support.replicator("cpu", 1))
        reference.train(batches)
        trainer = Trainer(support.replicator(target, n))
        trainer.train(batches)
        self.assertWeightsClose(trainer.weights(), reference.weights())
        self.assertEqual(int(trainer.opt.iterations.numpy()), 10)
        # The run actually moved the weights (not a vacuous equality).
        self.assertGreater(np.abs(trainer.weights()[0] - Trainer(support.replicator("cpu", 1)).weights()[0]).max(), 1e-3)

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_adam_slots_built_in_scope_lazily(self, target, n):
        batches = _batches(3)
        make = lambda: keras.optimizers.Adam(1e-2)
        # No batch norm: the conv bias before it has a gradient of ~0, which Adam's
        # g / sqrt(v) turns from rounding noise into O(lr) steps.
        reference = Trainer(support.replicator("cpu", 1), make_opt=make, norm=False)
        reference.train(batches)
        trainer = Trainer(support.replicator(target, n), make_opt=make, norm=False)
        trainer.train(batches)
        self.assertWeightsClose(trainer.weights(), reference.weights())

    @parameterized.named_parameters(*support.named_replicators())
    def test_accumulation_equals_large_batch(self, target, n):
        big = _batches(3, batch=32)
        # No batch norm here: its statistics depend on the batch size by design.
        reference = Trainer(support.replicator("cpu", 1), norm=False)
        reference.train(big)
        trainer = Trainer(support.replicator(target, n), accumulate_steps=4, norm=False)
        micro = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for x, y in big for i in range(4)]
        trainer.train(micro[:6])
        self.assertEqual(int(trainer.opt.iterations.numpy()), 1)
        trainer.train(micro[6:])
        self.assertEqual(int(trainer.opt.iterations.numpy()), 3)
        self.assertWeightsClose(trainer.weights(), reference.weights())

    def test_clipping_happens_after_the_cross_replica_mean(self):
        batches = _batches(2)
        reference = Trainer(support.replicator("cpu", 1), clip=0.05)
        reference.train(batches)
        trainer = Trainer(support.replicator("cpu", 4), clip=0.05)
        trainer.train(batches)
        self.assertWeightsClose(trainer.weights(), reference.weights())
        unclipped = Trainer(support.replicator("cpu", 1))
        unclipped.train(batches)
        self.assertGreater(np.abs(unclipped.weights()[0] - reference.weights()[0]).max(), 1e-4)

    @parameterized.named_parameters(("four_to_one", 4, 1), ("four_to_two", 4, 2), ("one_to_four", 1, 4),
                                    ("two_to_four_accumulating", 2, 4, 2))
    def test_checkpoint_portable_across_replica_counts(self, before, after, accumulate=1):
        batches = _batches(8)
        straight = Trainer(support.replicator("cpu", 1), accumulate_steps=accumulate)
        straight.train(batches)
        first = Trainer(support.replicator("cpu", before), accumulate_steps=accumulate)
        first.train(batches[:3])  # with accumulation, stops mid-accumulation
        path = tf.train.Checkpoint(model=first.model, opt=first.opt).save(os.path.join(self.get_temp_dir(), "ckpt"))
        second = Trainer(support.replicator("cpu", after), accumulate_steps=accumulate)
        with second.rep.scope():  # slots must exist to be restored into
            second.opt.build(second.model.trainable_variables)
        tf.train.Checkpoint(model=second.model, opt=second.opt).restore(path).assert_consumed()
        second.train(batches[3:])
        self.assertWeightsClose(second.weights(), straight.weights())

    def test_dynamic_loss_scale_skips_non_finite_updates(self):
        trainer = Trainer(support.replicator("cpu", 2), loss_scale="dynamic")
        self.assertEqual(float(trainer.opt.loss_scale.numpy()), 2.0 ** 15)
        x, y = _batches(1)[0]
        before = trainer.weights()
        bad = x.copy()
        bad[0, 0, 0, 0] = np.inf  # only replica 0 sees it; the global gradient is non-finite
        trainer.train([(bad, y)])
        self.assertWeightsClose(trainer.weights()[:2], before[:2], atol=0)
        self.assertEqual(float(trainer.opt.loss_scale.numpy()), 2.0 ** 14)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 0)
        trainer.train([(x, y)])
        self.assertEqual(int(trainer.opt.iterations.numpy()), 1)
        reference = Trainer(support.replicator("cpu", 1))
        reference.train([(x, y)])
        self.assertWeightsClose(trainer.weights()[:2], reference.weights()[:2], atol=1e-5)

    def test_bad_arguments(self):
        rep = support.replicator("cpu", 2)
        outside = keras.optimizers.SGD(0.1)
        with rep.scope():
            with self.assertRaisesRegex(xf.ConfigError, "created outside the Replicator's scope"):
                xf.wrap_optimizer(outside)
            for kwargs, pattern in ((dict(accumulate_steps=0), "accumulate_steps=0"),
                                    (dict(clip_global_norm=-1.0), "clip_global_norm=-1.0"),
                                    (dict(loss_scale="auto"), "loss_scale='auto'")):
                with self.assertRaisesRegex(xf.ConfigError, pattern):
                    xf.wrap_optimizer(keras.optimizers.SGD(0.1), **kwargs)
