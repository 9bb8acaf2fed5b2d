"""Epochs: the trainer's bindings in epochs, converted to steps, and the epoch of a step
(and the checks of the trainer's counts, in steps or epochs).

A train pipeline here is endless (its batches are drawn from one global stream of
examples, `expframe/data/order.py`, with `drop_remainder=True`), so an epoch is not a
pass that ends with a short batch. It is a number of steps:

    steps_per_epoch = train_examples // (global_batch_size x accumulate_steps)

rounded down, as `WarmupSchedule` counts it (expframe/schedules.py), so epochs given
to the trainer and to a schedule name the same steps. E epochs are floor(E x
steps_per_epoch) steps (E may be fractional, e.g. 0.5); the same for intervals in
epochs (`Trainer.eval_every_epochs`, `Trainer.checkpoint_every_epochs`), which must
come to at least one step.

The epoch logged with each train record and on the progress line is step /
steps_per_epoch: 2.0 when a run of `Trainer.train_epochs = 2` ends. When the batch
does not divide the split, the examples read by then are a little fewer than two
passes (2 x steps_per_epoch x batch), and the stream's next pass starts inside a
step rather than at one: nothing is dropped, and an example is read once per pass.

    spe = steps_per_epoch(20_000, 256, what="ClassificationTask")   # 78
    steps("Trainer.train_epochs", 10, spe)                         # 780
    epoch_at(390, spe)                                             # 5.0
"""

import math
from typing import Dict, Optional

from expframe.errors import ConfigError

# floor(E x S) of a float E that is meant to be whole (0.29 x 100 = 28.999999999999996).
_SLACK = 1e-9


def positive_int(binding: str, value, allow_none: bool = False) -> Optional[int]:
    """`value` if it is a positive int (or None when allowed), else a ConfigError naming
    `binding` (with the int to write for a whole float: gin reads 1e3 as 1000.0)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        whole = isinstance(value, float) and value.is_integer() and value >= 1
        hint = f" (write {int(value)}: gin reads 1e3 or 1000.0 as a float)" if whole else ""
        raise ConfigError(f"{binding}={value!r} must be a positive integer{' or None' if allow_none else ''}{hint}.")
    return value


def positive_number(binding: str, value, allow_none: bool = True) -> Optional[float]:
    """`value` if it is a positive int or float (or None when allowed), else a ConfigError."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{binding}={value!r} must be a positive number of epochs (e.g. 10 or 0.5)"
                          f"{' or None' if allow_none else ''}.")
    return value


def check_bindings(steps: Dict[str, Optional[int]], in_epochs: Dict[str, Optional[float]]) -> None:
    """Each cadence in steps or in epochs, not both; the run's length in one of them.

    Args:
      steps: {"train": Trainer.train_steps, "eval_every": ..., "checkpoint_every": ...}.
      in_epochs: the same names: Trainer.train_epochs, eval_every_epochs, ...

    Raises:
      ConfigError: one line naming the bindings.
    """
    for name, value in in_epochs.items():
        if steps.get(name) is not None and value is not None:
            raise ConfigError(f"Trainer.{name}_steps={steps[name]!r} and Trainer.{name}_epochs={value!r} are both "
                              f"bound: bind one of them (to replace a gin file's Trainer.{name}_steps, add "
                              f"--gin_param='Trainer.{name}_steps = None').")
        positive_number(f"Trainer.{name}_epochs", value)
    if steps.get("train") is None and in_epochs.get("train") is None:
        raise ConfigError("Trainer.train_steps and Trainer.train_epochs are both unbound: bind one of them "
                          "(e.g. Trainer.train_steps = 1000, or Trainer.train_epochs = 10).")


def steps_per_epoch(train_examples: Optional[int], examples_per_step: int, what: str) -> int:
    """Steps in one epoch: train_examples // examples_per_step.

    Args:
      train_examples: examples in one pass over the train split; None if unknown.
      examples_per_step: examples one train step consumes over all replicas
        (the global batch times the micro-batches of an update).
      what: the task, for messages.

    Raises:
      ConfigError: the split's size is unknown, or smaller than one step.
    """
    if train_examples is None:
        raise ConfigError(
            f"Trainer.train_epochs (or another binding in epochs) needs the size of the train data, but {what} "
            "does not know it (an endless or generated stream, or a dataset of unknown cardinality: "
            "Task.train_examples() returned None); bind Trainer.train_steps and the *_every_steps "
            "cadences instead.")
    if train_examples < examples_per_step:
        raise ConfigError(
            f"{what}'s train split holds {train_examples:,} examples, fewer than one step consumes "
            f"({examples_per_step:,}: Trainer.global_batch_size x wrap_optimizer.accumulate_steps), so an epoch "
            "is less than one step; bind Trainer.train_steps instead, or use a smaller batch.")
    return train_examples // examples_per_step


def steps(binding: str, epochs: float, per_epoch: int) -> int:
    """floor(epochs x per_epoch), at least 1 (else a ConfigError naming `binding`)."""
    count = math.floor(epochs * per_epoch + _SLACK)
    if count < 1:
        raise ConfigError(f"{binding}={epochs!r} is less than one step (an epoch is {per_epoch} steps); "
                          f"use at least {1 / per_epoch:.4g}.")
    return count


def epoch_at(step: int, per_epoch: int) -> float:
    """The epoch reached after `step` steps: step / steps_per_epoch (module docstring)."""
    return step / per_epoch


def describe(train_steps: int, train_epochs: Optional[float], per_epoch: Optional[int]) -> str:
    """The run's length for its first line: `640 steps`, `640 steps (20 epochs of 32 steps)`."""
    if train_epochs is None:
        return f"{train_steps} steps"
    return f"{train_steps} steps ({train_epochs:g} epoch{'' if train_epochs == 1 else 's'} of {per_epoch} steps)"
