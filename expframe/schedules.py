"""Learning-rate schedules: large-batch warm-up, and constant-then-linear decay.

`WarmupSchedule` is the recipe of Goyal et al. 2017 ("Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour"): the linear scaling rule, a gradual warm-up, then a
step (or cosine) decay. With steps s, S = steps_per_epoch, W = warmup_epochs * S:

    peak  = base_learning_rate * global_batch_size / 256          (linear scaling rule)
    lr(s) = init + (peak - init) * s / W                          for s < W (linear warm-up)
    step:   lr(s) = peak * decay_factor ** #{e in boundaries_epochs : s >= e * S}
    cosine: lr(s) = peak * (1 + cos(pi * (s - W) / (T - W))) / 2,  T = total_epochs * S,
            reaching 0 at s = T and staying there.

`init` is `warmup_initial_learning_rate`, 0 by default (so the first step, s = 0, makes
no update); Goyal et al. start from the unscaled base rate: set it to
`base_learning_rate` for exactly their schedule.

One source of truth for the batch. In a run, the task builds its optimizer inside
`training_run(examples_per_update, examples_per_epoch)`, and a WarmupSchedule built
there takes `global_batch_size` from the run (`Trainer.global_batch_size`, times
`wrap_optimizer.accumulate_steps`: the examples of one optimizer update) and
`steps_per_epoch` = train examples // that batch. Change the trainer's batch and
the peak rate and the epoch boundaries follow. Binding either value in gin as well
is allowed only if it agrees with the run (else a ConfigError: exit 2).

Example (ResNet-50, batch 1024 from the trainer, 90 epochs of 1,281,167 images):
    WarmupSchedule.base_learning_rate = 0.1   # peak 0.1 x 1024 / 256 = 0.4
    WarmupSchedule.warmup_epochs = 5
    SGD.learning_rate = @WarmupSchedule()
Outside a run, give both: `WarmupSchedule(global_batch_size=1024, steps_per_epoch=1251)`.

`ConstantThenLinearDecay` holds a rate, then decays it linearly to an end value, as
Chainer's `LinearShift` does in the official SN-GAN code (configs/sn_projection.yml:
2e-4 until generator iteration 400,000, 0 at 450,000). It counts *steps*, each of
`updates_per_step` optimizer updates, so an optimizer that makes several updates per
train step (the GAN discriminator: `GANTask.disc_steps`) keys the same decay to the
same train steps as the generator. A task that builds such an optimizer says how
many updates it makes per step (`with updates_per_step(n):`, as `GANTask` does), and
the schedule takes that number: change `GANTask.disc_steps` and the schedule follows.

    k     = floor(s / updates_per_step)              (s: the optimizer's update count)
    lr(s) = initial                                   for k <= decay_start_step
          = initial + (end - initial) * (k - decay_start_step) / (decay_end_step - decay_start_step)
          = end                                       for k >= decay_end_step
"""

import contextlib
import contextvars
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import gin
import keras
import tensorflow as tf

from expframe.errors import ConfigError

_REFERENCE_BATCH = 256  # Goyal et al.: lr 0.1 per 256 examples.


class _Run(NamedTuple):
    global_batch_size: int
    examples_per_epoch: Callable[[], Optional[int]]


_RUN: contextvars.ContextVar = contextvars.ContextVar("expframe_training_run", default=None)
_UPDATES_PER_STEP: contextvars.ContextVar = contextvars.ContextVar("expframe_updates_per_step", default=None)


@contextlib.contextmanager
def training_run(global_batch_size: int,
                 examples_per_epoch: Union[int, None, Callable[[], Optional[int]]]) -> Iterator[None]:
    """Schedules built inside take the run's batch and epoch size (see module docstring).

    Args:
      global_batch_size: examples per optimizer update over all replicas
        (`Trainer.global_batch_size` x `wrap_optimizer.accumulate_steps`).
      examples_per_epoch: examples in one pass over the train data, or a function that
        counts them (called only if a schedule needs it; it may return None: unknown).
    """
    count = examples_per_epoch if callable(examples_per_epoch) else (lambda: examples_per_epoch)
    token = _RUN.set(_Run(global_batch_size, count))
    try:
        yield
    finally:
        _RUN.reset(token)


@contextlib.contextmanager
def updates_per_step(count: int) -> Iterator[None]:
    """Schedules built inside count `count` optimizer updates as one step
    (`ConstantThenLinearDecay.updates_per_step`): for a task whose optimizer makes
    several updates per train step."""
    token = _UPDATES_PER_STEP.set(count)
    try:
        yield
    finally:
        _UPDATES_PER_STEP.reset(token)


def _from_run(global_batch_size: Optional[int], steps_per_epoch: Optional[int]):
    """(global_batch_size, steps_per_epoch): bound values checked against the run's."""
    run = _RUN.get()
    if run is None:
        if global_batch_size is None or steps_per_epoch is None:
            raise ConfigError(
                "WarmupSchedule outside a run needs global_batch_size and steps_per_epoch; in a run "
                "(main.py) both come from the trainer's batch and the train data's size.")
        return global_batch_size, steps_per_epoch
    if global_batch_size is not None and global_batch_size != run.global_batch_size:
        raise ConfigError(
            f"WarmupSchedule.global_batch_size={global_batch_size!r} but the run takes {run.global_batch_size} "
            "examples per optimizer step (Trainer.global_batch_size x wrap_optimizer.accumulate_steps): "
            "remove the WarmupSchedule binding, the schedule takes the run's.")
    global_batch_size = run.global_batch_size
    if steps_per_epoch is not None and not isinstance(steps_per_epoch, int):
        return global_batch_size, steps_per_epoch  # the range check below names it
    examples = run.examples_per_epoch()
    if examples is None:
        if steps_per_epoch is None:
            raise ConfigError(
                "WarmupSchedule: the size of the train data is unknown (its dataset has no known "
                "cardinality); bind WarmupSchedule.steps_per_epoch.")
        return global_batch_size, steps_per_epoch
    derived = max(1, examples // global_batch_size)
    if steps_per_epoch is not None and steps_per_epoch != derived:
        raise ConfigError(
            f"WarmupSchedule.steps_per_epoch={steps_per_epoch!r} but the train data holds {examples:,} "
            f"examples, {derived} steps of the global batch {global_batch_size}: remove the "
            "binding, the schedule derives it.")
    return global_batch_size, derived


@gin.configurable
@keras.saving.register_keras_serializable(package="expframe")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear scaling rule + linear warm-up + step or cosine decay (see module docstring).

    Args:
      base_learning_rate: learning rate for a batch of 256 examples.
      global_batch_size: examples per optimizer step over all replicas; None (the
        default): the run's (`Trainer.global_batch_size`, see `training_run`).
      steps_per_epoch: optimizer steps per epoch (epochs below are converted with it);
        None (the default): the run's train examples // global_batch_size.
      warmup_epochs: length of the linear warm-up, in epochs (may be fractional; 0 for none).
      decay: "step" (multiply by `decay_factor` at each of `boundaries_epochs`) or
        "cosine" (half a cosine from the peak to 0 at `total_epochs`).
      boundaries_epochs: epochs at whose first step the step decay applies.
      decay_factor: multiplier per boundary of the step decay.
      total_epochs: end of the cosine decay (ignored by "step").
      warmup_initial_learning_rate: learning rate at step 0 (0 by default).
    """

    def __init__(self,
                 base_learning_rate: float = 0.1,
                 global_batch_size: Optional[int] = None,
                 steps_per_epoch: Optional[int] = None,
                 warmup_epochs: float = 5,
                 decay: str = "step",
                 boundaries_epochs: Sequence[float] = (30, 60, 80),
                 decay_factor: float = 0.1,
                 total_epochs: float = 90,
                 warmup_initial_learning_rate: float = 0.0):
        global_batch_size, steps_per_epoch = _from_run(global_batch_size, steps_per_epoch)
        if decay not in ("step", "cosine"):
            raise ConfigError(f"WarmupSchedule.decay={decay!r} must be 'step' or 'cosine'.")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                   for v in (steps_per_epoch, global_batch_size)):
            raise ConfigError(
                f"WarmupSchedule needs integers steps_per_epoch >= 1 and global_batch_size >= 1, got "
                f"steps_per_epoch={steps_per_epoch!r}, global_batch_size={global_batch_size!r}.")
        boundaries_epochs = tuple(boundaries_epochs)
        if list(boundaries_epochs) != sorted(boundaries_epochs):
            raise ConfigError(f"WarmupSchedule.boundaries_epochs={boundaries_epochs!r} must be increasing.")
        if decay == "cosine" and not warmup_epochs < total_epochs:
            raise ConfigError(
                f"WarmupSchedule.warmup_epochs={warmup_epochs!r} must be less than "
                f"WarmupSchedule.total_epochs={total_epochs!r} for decay='cosine'.")
        self.base_learning_rate = base_learning_rate
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = steps_per_epoch
        self.warmup_epochs = warmup_epochs
        self.decay = decay
        self.boundaries_epochs = boundaries_epochs
        self.decay_factor = decay_factor
        self.total_epochs = total_epochs
        self.warmup_initial_learning_rate = warmup_initial_learning_rate

        self.peak_learning_rate = base_learning_rate * global_batch_size / _REFERENCE_BATCH
        self.warmup_steps = int(round(warmup_epochs * steps_per_epoch))
        self.total_steps = int(round(total_epochs * steps_per_epoch))
        if decay == "cosine":
            # Keras' CosineDecay does the warm-up itself: from initial_learning_rate to
            # warmup_target over warmup_steps, then the cosine over decay_steps.
            self._after_warmup = keras.optimizers.schedules.CosineDecay(
                initial_learning_rate=warmup_initial_learning_rate,
                decay_steps=self.total_steps - self.warmup_steps, alpha=0.0,
                warmup_target=self.peak_learning_rate, warmup_steps=self.warmup_steps)
        else:
            # PiecewiseConstantDecay switches *after* a boundary (step > b); the decayed
            # rate must apply from the first step of the boundary epoch (step >= e * S).
            self._after_warmup = keras.optimizers.schedules.PiecewiseConstantDecay(
                boundaries=[int(round(e * steps_per_epoch)) - 1 for e in boundaries_epochs],
                values=[self.peak_learning_rate * decay_factor ** i
                        for i in range(len(boundaries_epochs) + 1)])

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        decayed = tf.cast(self._after_warmup(step), tf.float32)
        if self.decay == "cosine" or self.warmup_steps == 0:
            return decayed
        init, peak = self.warmup_initial_learning_rate, self.peak_learning_rate
        warming = init + (peak - init) * step / self.warmup_steps
        return tf.where(step < self.warmup_steps, warming, decayed)

    def get_config(self):
        return {
            "base_learning_rate": self.base_learning_rate,
            "global_batch_size": self.global_batch_size,
            "steps_per_epoch": self.steps_per_epoch,
            "warmup_epochs": self.warmup_epochs,
            "decay": self.decay,
            "boundaries_epochs": list(self.boundaries_epochs),
            "decay_factor": self.decay_factor,
            "total_epochs": self.total_epochs,
            "warmup_initial_learning_rate": self.warmup_initial_learning_rate,
        }


@gin.configurable
@keras.saving.register_keras_serializable(package="expframe")
class ConstantThenLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """A constant rate, then a linear decay to `end_learning_rate` (see module docstring).

    Keras calls a schedule with the optimizer's update count before the update (0 for
    the first), so update s uses lr(s): as Chainer's `LinearShift`, which sets the rate
    of iteration i + 1 from i after each iteration.

    Example (the official SN-GAN 128 px schedule, 5 discriminator updates per step):
        generator/ConstantThenLinearDecay.initial_learning_rate = 2e-4
        generator/ConstantThenLinearDecay.decay_start_step = 400_000
        generator/ConstantThenLinearDecay.decay_end_step = 450_000
        # the discriminator's: updates_per_step = GANTask.disc_steps, given by the task

    Args:
      initial_learning_rate: the rate up to and including step `decay_start_step`.
      decay_start_step: the last step at the initial rate (in steps, not updates).
      decay_end_step: the first step at `end_learning_rate`; > decay_start_step.
      end_learning_rate: the rate from `decay_end_step` on.
      updates_per_step: optimizer updates per step (the schedule's count is divided by
        it); None (the default): the task's (`with updates_per_step(n):` around the
        optimizer's construction; `GANTask` gives the discriminator `disc_steps`), else 1.
        A bound value must agree with the task's.
    """

    def __init__(self, initial_learning_rate: float = gin.REQUIRED, decay_start_step: int = gin.REQUIRED,
                 decay_end_step: int = gin.REQUIRED, end_learning_rate: float = 0.0,
                 updates_per_step: Optional[int] = None):
        from_task = _UPDATES_PER_STEP.get()
        if updates_per_step is not None and from_task is not None and updates_per_step != from_task:
            raise ConfigError(
                f"ConstantThenLinearDecay.updates_per_step={updates_per_step!r} but the task makes {from_task} "
                "optimizer update(s) per step (for a GAN's discriminator: GANTask.disc_steps): remove the "
                "binding, the schedule takes the task's.")
        if updates_per_step is None:
            updates_per_step = 1 if from_task is None else from_task
        for name, value, least in (("decay_start_step", decay_start_step, 0), ("decay_end_step", decay_end_step, 0),
                                   ("updates_per_step", updates_per_step, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"ConstantThenLinearDecay.{name}={value!r} must be an integer >= {least}.")
        if decay_end_step <= decay_start_step:
            raise ConfigError(
                f"ConstantThenLinearDecay.decay_end_step={decay_end_step} must be greater than "
                f"ConstantThenLinearDecay.decay_start_step={decay_start_step}.")
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_start_step, self.decay_end_step = decay_start_step, decay_end_step
        self.end_learning_rate = float(end_learning_rate)
        self.updates_per_step = updates_per_step

    def __call__(self, step):
        # int64 floor division: exact at any step count (float32 is not, beyond 2^24).
        k = tf.cast(tf.math.floordiv(tf.cast(step, tf.int64), self.updates_per_step), tf.float64)
        start, end = float(self.decay_start_step), float(self.decay_end_step)
        fraction = tf.clip_by_value((k - start) / (end - start), 0.0, 1.0)
        initial, final = self.initial_learning_rate, self.end_learning_rate
        return tf.cast(initial + (final - initial) * fraction, tf.float32)

    def get_config(self):
        return {"initial_learning_rate": self.initial_learning_rate, "decay_start_step": self.decay_start_step,
                "decay_end_step": self.decay_end_step, "end_learning_rate": self.end_learning_rate,
                "updates_per_step": self.updates_per_step}
