"""WarmupSchedule and ConstantThenLinearDecay against their formulas at the points where they change."""

import math
import os

import gin
import keras
import tensorflow as tf

from expframe import config
from expframe.errors import ConfigError
from expframe.replicator import Replicator
from expframe.schedules import ConstantThenLinearDecay, WarmupSchedule, training_run, updates_per_step
from expframe.tasks.classification import ClassificationTask
from expframe.trainer import Trainer
from tests.support import TestCase

FAKE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "experiments", "resnet50_imagenet_fake.gin")
S = 100          # steps per epoch
PEAK = 0.1 * 1024 / 256  # linear scaling rule: 0.4


def _lr(schedule, step):
    return float(schedule(tf.constant(step, tf.int64)))


class WarmupScheduleTest(TestCase):

    def test_step_decay(self):
        s = WarmupSchedule(base_learning_rate=0.1, global_batch_size=1024, steps_per_epoch=S)
        self.assertAllClose(s.peak_learning_rate, PEAK)
        expected = {
            0: 0.0,
            1: PEAK / (5 * S),
            250: PEAK / 2,                 # half-way through the 5-epoch warm-up
            5 * S - 1: PEAK * (5 * S - 1) / (5 * S),
            5 * S: PEAK,                   # end of warm-up
            30 * S - 1: PEAK,
            30 * S: PEAK * 0.1,            # first step of epoch 30
            60 * S - 1: PEAK * 0.1,
            60 * S: PEAK * 0.01,
            80 * S - 1: PEAK * 0.01,
            80 * S: PEAK * 0.001,
            90 * S: PEAK * 0.001,
            10**6: PEAK * 0.001,
        }
        for step, lr in expected.items():
            self.assertAllClose(_lr(s, step), lr, rtol=1e-6, atol=1e-9, msg=f"step {step}")

    def test_cosine_decay(self):
        s = WarmupSchedule(global_batch_size=1024, steps_per_epoch=S, decay="cosine", total_epochs=90)
        warm, total = 5 * S, 90 * S
        self.assertAllClose(_lr(s, 0), 0.0)
        self.assertAllClose(_lr(s, warm // 2), PEAK / 2, rtol=1e-6)
        self.assertAllClose(_lr(s, warm), PEAK, rtol=1e-6)
        for step in (warm + 1, (warm + total) // 2, total - 1):
            want = PEAK * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            self.assertAllClose(_lr(s, step), want, rtol=1e-4, atol=1e-7, msg=f"step {step}")
        self.assertAllClose(_lr(s, total), 0.0, atol=1e-7)      # cosine endpoint
        self.assertAllClose(_lr(s, total + 500), 0.0, atol=1e-7)

    def test_warmup_from_base_rate_and_no_warmup(self):
        s = WarmupSchedule(global_batch_size=1024, steps_per_epoch=S, warmup_initial_learning_rate=0.1)
        self.assertAllClose(_lr(s, 0), 0.1)                       # Goyal et al.: from the base rate
        self.assertAllClose(_lr(s, 250), 0.1 + (PEAK - 0.1) / 2, rtol=1e-6)
        s = WarmupSchedule(global_batch_size=512, steps_per_epoch=S, warmup_epochs=0,
                           boundaries_epochs=(2,), decay_factor=0.5)
        self.assertAllClose(_lr(s, 0), 0.2)
        self.assertAllClose(_lr(s, 2 * S), 0.1)

    def test_fractional_epochs(self):
        s = WarmupSchedule(global_batch_size=256, steps_per_epoch=10, warmup_epochs=0.5, boundaries_epochs=(1.5,))
        self.assertEqual(s.warmup_steps, 5)
        self.assertAllClose(_lr(s, 5), 0.1)
        self.assertAllClose(_lr(s, 14), 0.1)
        self.assertAllClose(_lr(s, 15), 0.01)

    def test_serialisable_and_usable_by_an_optimizer(self):
        s = WarmupSchedule(global_batch_size=1024, steps_per_epoch=S, decay="cosine")
        clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
        self.assertIsInstance(clone, WarmupSchedule)
        self.assertEqual(clone.get_config(), s.get_config())
        self.assertAllClose(_lr(clone, 1234), _lr(s, 1234))
        optimizer = keras.optimizers.SGD(learning_rate=s)
        optimizer.iterations.assign(30 * S)
        self.assertAllClose(float(optimizer.learning_rate), _lr(s, 30 * S))

    def test_gin(self):
        gin.parse_config("""
            WarmupSchedule.global_batch_size = 2048
            WarmupSchedule.steps_per_epoch = 10
            WarmupSchedule.decay = 'cosine'
        """)
        s = WarmupSchedule()
        self.assertAllClose(s.peak_learning_rate, 0.8)
        self.assertEqual(s.total_steps, 900)

    def test_bad_values_are_config_errors(self):
        with self.assertRaisesRegex(ConfigError, "WarmupSchedule.decay='linear'"):
            WarmupSchedule(global_batch_size=256, steps_per_epoch=1, decay="linear")
        with self.assertRaisesRegex(ConfigError, "boundaries_epochs"):
            WarmupSchedule(global_batch_size=256, steps_per_epoch=1, boundaries_epochs=(60, 30))
        with self.assertRaisesRegex(ConfigError, "warmup_epochs"):
            WarmupSchedule(global_batch_size=256, steps_per_epoch=1, decay="cosine", warmup_epochs=90)
        with self.assertRaisesRegex(ConfigError, "steps_per_epoch"):
            WarmupSchedule(global_batch_size=256, steps_per_epoch=0)


class TrainingRunTest(TestCase):
    """One source of truth for the batch: in a run, the schedule takes the trainer's."""

    def test_takes_the_batch_and_the_epoch_from_the_run(self):
        counted = []
        with training_run(512, lambda: counted.append(1) or 51_234):
            s = WarmupSchedule(warmup_epochs=1, boundaries_epochs=(2,))
        self.assertEqual((s.global_batch_size, s.steps_per_epoch), (512, 100))  # 51,234 // 512
        self.assertEqual(counted, [1])
        self.assertAllClose(s.peak_learning_rate, 0.1 * 512 / 256)
        self.assertAllClose(_lr(s, 50), 0.2 / 2)
        self.assertAllClose(_lr(s, 199), 0.2)
        self.assertAllClose(_lr(s, 200), 0.02)
        # Bound values that agree with the run are fine; the data is counted only when needed.
        with training_run(512, 51_234):
            self.assertEqual(WarmupSchedule(global_batch_size=512, steps_per_epoch=100).steps_per_epoch, 100)
        with training_run(512, lambda: None):
            self.assertEqual(WarmupSchedule(steps_per_epoch=7).steps_per_epoch, 7)

    def test_a_mismatch_with_the_run_is_a_config_error(self):
        with training_run(8, 64):
            with self.assertRaisesRegex(ConfigError, r"WarmupSchedule.global_batch_size=1024 but the run takes 8 "
                                                     r"examples per optimizer step \(Trainer.global_batch_size"):
                WarmupSchedule(global_batch_size=1024)
            with self.assertRaisesRegex(ConfigError, r"WarmupSchedule.steps_per_epoch=1251 but the train data "
                                                     r"holds 64 examples, 8 steps"):
                WarmupSchedule(steps_per_epoch=1251)
        with training_run(8, lambda: None):
            with self.assertRaisesRegex(ConfigError, "bind WarmupSchedule.steps_per_epoch"):
                WarmupSchedule()
        with self.assertRaisesRegex(ConfigError, "outside a run needs global_batch_size and steps_per_epoch"):
            WarmupSchedule(global_batch_size=256)

    def _schedule_built_by_the_task(self, params):
        """The fake ResNet-50 experiment's schedule, as its task builds it (small model)."""
        config.parse([FAKE], ["resnet.depth = 8", "resnet.input_shape = (32, 32, 3)"] + params)
        replicator, trainer, task = Replicator(), Trainer(), ClassificationTask()
        task.setup(replicator, trainer.global_batch_size, seed=0, deterministic=False)
        with replicator.scope():
            task.build()
        return task.optimizer.optimizer._learning_rate  # pylint: disable=protected-access

    def test_overriding_the_trainer_batch_alone_moves_the_schedule(self):
        small = self._schedule_built_by_the_task([])  # the fake's Trainer.global_batch_size = 8, 64 examples
        self.assertIsInstance(small, WarmupSchedule)
        self.assertEqual((small.global_batch_size, small.steps_per_epoch), (8, 64 // 8))
        self.assertAllClose(small.peak_learning_rate, 0.1 * 8 / 256)
        gin.clear_config()
        large = self._schedule_built_by_the_task(["Trainer.global_batch_size = 16"])
        self.assertEqual((large.global_batch_size, large.steps_per_epoch), (16, 64 // 16))
        self.assertAllClose(large.peak_learning_rate, 0.1 * 16 / 256)
        self.assertAllClose(_lr(large, 5 * 4), 0.1 * 16 / 256)  # warm-up ends after 5 epochs of 4 steps
        gin.clear_config()
        # With accumulation an update takes k micro-batches: the schedule counts k x the batch.
        accumulated = self._schedule_built_by_the_task(["wrap_optimizer.accumulate_steps = 2"])
        self.assertEqual((accumulated.global_batch_size, accumulated.steps_per_epoch), (16, 64 // 16))
        gin.clear_config()
        with self.assertRaisesRegex(ConfigError,
                                    "WarmupSchedule.global_batch_size=1024 but the run takes 8 examples"):
            self._schedule_built_by_the_task(["WarmupSchedule.global_batch_size = 1024"])


def _linear_shift_rates(value_range, time_range, updates):
    """The rate each of `updates` iterations uses under Chainer's LinearShift, simulated as
    its trainer runs it: the rate is set from _t = 0 before the first iteration, then
    after every iteration _t += 1 and the rate for the next one is set from _t."""
    (v1, v2), (t1, t2) = value_range, time_range

    def value(t):
        if t <= t1:
            return v1
        if t >= t2:
            return v2
        return v1 + (t - t1) / (t2 - t1) * (v2 - v1)

    rates, t, rate = [], 0, value(0)
    for _ in range(updates):
        rates.append(rate)  # this iteration's update uses the current rate
        t += 1
        rate = value(t)
    return rates


class ConstantThenLinearDecayTest(TestCase):
    """The official SN-GAN 128 px schedule: 2e-4 to generator iteration 400,000, 0 at 450,000."""

    def test_boundaries_of_the_published_schedule(self):
        s = ConstantThenLinearDecay(initial_learning_rate=2e-4, decay_start_step=400_000, decay_end_step=450_000)
        expected = {0: 2e-4, 1: 2e-4, 399_999: 2e-4, 400_000: 2e-4, 400_001: 2e-4 * (1 - 1 / 50_000),
                    425_000: 1e-4, 449_999: 2e-4 / 50_000, 450_000: 0.0, 450_001: 0.0, 10**7: 0.0}
        for step, lr in expected.items():
            self.assertAllClose(_lr(s, step), lr, rtol=1e-6, atol=1e-12, msg=f"step {step}")

    def test_discriminator_counts_disc_steps_updates_per_generator_step(self):
        g = ConstantThenLinearDecay(initial_learning_rate=2e-4, decay_start_step=400_000, decay_end_step=450_000)
        with updates_per_step(5):
            d = ConstantThenLinearDecay(initial_learning_rate=2e-4, decay_start_step=400_000, decay_end_step=450_000)
        self.assertEqual(d.updates_per_step, 5)
        # Discriminator update 5 i + j (j < 5) belongs to generator step i: the same rate.
        for i in (0, 399_999, 400_000, 400_001, 425_000, 449_999, 450_000):
            for j in (0, 4):
                self.assertAllClose(_lr(d, 5 * i + j), _lr(g, i), rtol=1e-6, atol=1e-12, msg=f"{i}, {j}")
        self.assertAllClose(_lr(d, 5 * 400_001 - 1), 2e-4)                # last update of step 400,000
        self.assertLess(_lr(d, 5 * 400_001), 2e-4)                        # first of step 400,001
        # A binding that agrees is fine; one that does not is a config error.
        with updates_per_step(5):
            ConstantThenLinearDecay(initial_learning_rate=1.0, decay_start_step=0, decay_end_step=1, updates_per_step=5)
            with self.assertRaisesRegex(ConfigError, r"ConstantThenLinearDecay.updates_per_step=1 but the task makes "
                                                     r"5 optimizer update\(s\) per step \(for a GAN's discriminator: "
                                                     r"GANTask.disc_steps\)"):
                ConstantThenLinearDecay(initial_learning_rate=1.0, decay_start_step=0, decay_end_step=1,
                                        updates_per_step=1)

    def test_matches_chainer_linear_shift_update_by_update(self):
        s = ConstantThenLinearDecay(initial_learning_rate=2.0, decay_start_step=3, decay_end_step=7,
                                    end_learning_rate=0.5)
        want = _linear_shift_rates((2.0, 0.5), (3, 7), 10)
        optimizer = keras.optimizers.SGD(learning_rate=s)  # Keras reads the rate at `iterations` before the update
        for update, rate in enumerate(want):
            optimizer.iterations.assign(update)
            self.assertAllClose(float(optimizer.learning_rate), rate, rtol=1e-6, msg=f"update {update}")

    def test_serialisable_gin_and_bad_values(self):
        s = ConstantThenLinearDecay(initial_learning_rate=2e-4, decay_start_step=4, decay_end_step=9,
                                    updates_per_step=3)
        clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
        self.assertEqual(clone.get_config(), s.get_config())
        self.assertAllClose(_lr(clone, 20), _lr(s, 20))
        gin.parse_config("""
            ConstantThenLinearDecay.initial_learning_rate = 0.1
            ConstantThenLinearDecay.decay_start_step = 10
            ConstantThenLinearDecay.decay_end_step = 20
        """)
        self.assertAllClose(_lr(ConstantThenLinearDecay(), 15), 0.05)
        gin.clear_config()
        for kwargs, message in (({"decay_start_step": 5, "decay_end_step": 5}, "decay_end_step=5 must be greater"),
                                ({"decay_start_step": -1, "decay_end_step": 5}, "decay_start_step=-1"),
                                ({"decay_start_step": 0, "decay_end_step": 5, "updates_per_step": 0},
                                 "updates_per_step=0")):
            with self.assertRaisesRegex(ConfigError, f"ConstantThenLinearDecay.{message}"):
                ConstantThenLinearDecay(initial_learning_rate=1.0, **kwargs)
