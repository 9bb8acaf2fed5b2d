"""The best checkpoint so far, by one eval metric, kept apart from the trainer's own.

    Trainer.best_checkpoint = ('top1', 'max')     # or ('loss', 'min'), ('fid', 'min'), ...

Whoever evaluates keeps it: the trainer in `--mode=train_and_eval`, or the continuous
evaluator (`--mode=continuous_eval`) when one runs (then only it). After an evaluation
at step S that beats the best so far, the evaluated state is written to
`<model_dir>/best/ckpt-S` (a tf.train checkpoint: the run's model, optimizer and step),
then `best/best.json` is replaced atomically:

    {"step": S, "metric": "top1", "mode": "max", "value": 0.93, "eval": {...}, "checkpoint": "ckpt-S"}

and only then is the previous best's files deleted. A reader follows best.json, so it
never sees a half-written best; the trainer's pruning (`Trainer.max_checkpoints`) works
in `checkpoints/` and never touches `best/`. `--mode=eval` and `--mode=export` take it
with `--checkpoint=best`.
"""

import json
import os
from typing import Dict, Optional

import tensorflow as tf

from expframe.atomic_files import write_json
from expframe.errors import ConfigError

FOLDER = "best"
INDEX = "best.json"
MODES = ("max", "min")


def check_binding(value) -> Optional[tuple]:
    """`Trainer.best_checkpoint` as (metric, mode), or None; a ConfigError if malformed."""
    if value is None:
        return None
    if (not isinstance(value, (tuple, list)) or len(value) != 2 or not isinstance(value[0], str)
            or value[1] not in MODES):
        raise ConfigError(f"Trainer.best_checkpoint={value!r} must be (metric, 'max' or 'min'), e.g. "
                          "('top1', 'max') or ('loss', 'min'); or None to keep no best checkpoint.")
    return tuple(value)


def read(model_dir: str) -> Optional[Dict]:
    """best/best.json of model_dir, or None if no best checkpoint was kept."""
    path = os.path.join(model_dir, FOLDER, INDEX)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def path_of(model_dir: str) -> Optional[str]:
    """The checkpoint prefix of model_dir's best checkpoint, or None."""
    best = read(model_dir)
    return None if best is None else os.path.join(model_dir, FOLDER, best["checkpoint"])


class BestCheckpoint:
    """Keeps `<model_dir>/best/` (see the module docstring).

    Args:
      model_dir: the run's directory, where the best so far is read once, now.
      metric, mode: the eval metric and whether higher ('max') or lower ('min') is better.
      write_dir: where this process writes (default model_dir): a non-chief worker writes
        into its private directory, as every worker takes part in writing a distributed
        checkpoint. Every worker decides alike: from the same metrics and the best read here.
    """

    def __init__(self, model_dir: str, metric: str, mode: str, write_dir: Optional[str] = None):
        self.metric, self.mode = metric, mode
        self.folder = os.path.join(write_dir or model_dir, FOLDER)
        self.is_chief = write_dir is None or write_dir == model_dir
        self._best = read(model_dir)

    def _better(self, value: float) -> bool:
        if self._best is None:
            return True
        return value > self._best["value"] if self.mode == "max" else value < self._best["value"]

    def consider(self, step: int, metrics: Dict[str, float], checkpoint: tf.train.Checkpoint) -> Optional[str]:
        """Keeps the state in `checkpoint` as the best if `metrics` beat the best so far;
        returns the line that says so (None if not, and on other workers than the chief).

        Raises:
          ConfigError: the evaluation has no `metric`.
        """
        if self.metric not in metrics:
            raise ConfigError(f"Trainer.best_checkpoint = ({self.metric!r}, {self.mode!r}) but the evaluation "
                              f"reports only {sorted(metrics)}: bind one of those.")
        value, was = float(metrics[self.metric]), self._best
        if (was is not None and was["step"] == step) or not self._better(value):
            return None
        name = f"ckpt-{step}"
        checkpoint.write(os.path.join(self.folder, name))
        self._best = {"step": int(step), "metric": self.metric, "mode": self.mode, "value": value,
                      "eval": {k: float(v) for k, v in metrics.items()}, "checkpoint": name}
        if not self.is_chief:
            return None
        write_json(os.path.join(self.folder, INDEX), self._best)
        self._remove_all_but(name)
        before = "" if was is None else f" (was {was['value']:.4f} at step {was['step']})"
        return f"best checkpoint: step {step}, {self.metric} {value:.4f}{before} -> {self.folder}"

    def _remove_all_but(self, keep: str) -> None:
        for entry in os.listdir(self.folder):
            if entry.startswith("ckpt-") and not entry.startswith(keep + "."):
                path = os.path.join(self.folder, entry)
                if os.path.isdir(path):
                    tf.io.gfile.rmtree(path)
                else:
                    os.remove(path)
