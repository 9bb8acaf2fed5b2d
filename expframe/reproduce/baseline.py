"""The eval metrics of an experiment's model before any training step.

A threshold such as "FID at most a quarter of its value at initialisation"
(`registry.SNGAN_SHAPES`) needs the untrained model's metrics, from the same gin files,
bindings and seed as the run. The slow test calls `initial_eval` in its process;
`python -m expframe.reproduce` runs this module in a subprocess:

    python -m expframe.reproduce.baseline --gin_file=experiments/sngan_shapes.gin \
        [--gin_param=...] --out=initial_eval.json

It builds what `run_experiment` builds (seeded Replicator, Trainer and task, in
float32) without a model_dir, and returns `task.evaluate`: nothing is trained, saved
or written but the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from expframe.atomic_files import write_json


def _bound(name: str, default):
    import gin  # pylint: disable=import-outside-toplevel
    try:
        return gin.query_parameter(name)
    except ValueError:  # not bound: run_experiment's default
        return default


def initial_eval(gin_files: Sequence[str], gin_params: Sequence[str] = ()) -> dict:
    """Parses the experiment and evaluates its task's model at initialisation.

    Returns:
      The task's eval metrics (e.g. {"fid", "inception_score", "sample_accuracy"}), with
      the task's `baseline_metrics()` where it has them (D4PG: "random_policy_return",
      "zero_action_return").
    """
    import gin  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel

    from expframe import config  # pylint: disable=import-outside-toplevel
    from expframe.replicator import Replicator  # pylint: disable=import-outside-toplevel
    from expframe.trainer import Trainer  # pylint: disable=import-outside-toplevel
    config.parse(list(gin_files), list(gin_params))
    try:
        seed, deterministic = _bound("run_experiment.seed", 0), _bound("run_experiment.deterministic", False)
        keras.utils.set_random_seed(seed)  # as run_experiment, before anything is built
        replicator = Replicator()
        trainer = Trainer()
        task = gin.query_parameter("run_experiment.task").scoped_configurable_fn()
        trainer.prepare(replicator, task, seed, deterministic)
        metrics = dict(task.evaluate(trainer.evaluator) or {})
        if hasattr(task, "baseline_metrics"):  # e.g. D4PG: the random policy's and zero action's returns
            metrics.update(task.baseline_metrics())
        return {k: float(v) for k, v in metrics.items()}
    finally:
        gin.clear_config()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expframe.reproduce.baseline",
                                     description="Eval metrics of an experiment's untrained model, as JSON.")
    parser.add_argument("--gin_file", action="append", default=[], required=True)
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from expframe.errors import ConfigError  # pylint: disable=import-outside-toplevel
    try:
        metrics = initial_eval(args.gin_file, args.gin_param)
    except ConfigError as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return ConfigError.exit_code
    write_json(args.out, metrics, make_dirs=True)
    print("at initialisation: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
