"""WarmupSchedule against its formula at the points where it changes."""

import math

import gin
import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.schedules import WarmupSchedule
from tests.support import TestCase

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
