"""run_experiment: model_dir, seeds, precision, Replicator, Task, Trainer; nothing is
written into the model_dir until the whole configuration has been validated."""

import os
import time

import gin
import keras
import tensorflow as tf

from expframe import gin_errors, provenance, run_files
from expframe.errors import ConfigError
from expframe.replicator import Replicator, auto_settings, cluster
from expframe.run_files import RunFiles
from expframe.tasks.base import Task
from expframe.trainer import Trainer

MODES = ("train", "eval", "train_and_eval")
PRECISIONS = auto_settings.PRECISIONS


def _precision_for(precision: str, replicator: Replicator) -> str:
    """The Keras policy: as bound, or for 'auto' the fastest measured on this machine
    (`Replicator.fastest_precision`; mixed_bfloat16 on a TPU, float32 on a mesh)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"run_experiment.precision={precision!r}: use one of {', '.join(PRECISIONS)}.")
    if replicator.target == "mesh" and precision.startswith("mixed"):
        # The tensor-parallel layers are tf.Modules of float32 DTensor variables: Keras'
        # dtype policy does not reach them, so the run would silently stay float32.
        raise ConfigError(
            f"run_experiment.precision={precision!r} is not available on Replicator.target='mesh': its "
            "tensor-parallel layers compute in float32 and would ignore it; use run_experiment.precision='float32' "
            "(or 'auto').")
    if precision == "auto" and replicator.target == "mesh":
        return "float32"  # the only precision the mesh's layers compute in
    return replicator.fastest_precision() if precision == "auto" else precision


def _gin_call(fn):
    """Calls fn, which calls configurables; the configuration's errors become ConfigErrors.

    A ConfigError passes through; a missing required binding, or a value of the wrong
    type or range raised inside a configurable (see `gin_errors.config_error_from`),
    becomes a one-line ConfigError; anything else (a failure of the run) is re-raised.
    """
    try:
        return fn()
    except ConfigError:
        raise
    except (TypeError, ValueError, RuntimeError) as e:
        error = gin_errors.config_error_from(e)
        if error is None:
            raise
        raise error from None


def _check_config_unchanged(model_dir: str, config_text: str, parsed_config: str) -> None:
    """Refuses to resume model_dir with a configuration other than the one it was run with.

    Compares what the gin files and bindings parse to (`gin.config_str()`: includes
    expanded, later bindings win, no paths), so `./experiments/x.gin` and
    `experiments/x.gin` are the same config and an edit inside an included file is a
    change. A model_dir written before parsed_config.gin existed is compared as given.
    """
    name, current = "parsed_config.gin", parsed_config
    previous = RunFiles.existing_config(model_dir, name)
    if previous is None:
        name, current = "config.gin", config_text
        previous = RunFiles.existing_config(model_dir, name)
    if previous is None or previous == current:
        return
    before = [line for line in previous.splitlines() if line and not line.startswith("#")]
    after = [line for line in current.splitlines() if line and not line.startswith("#")]
    removed = [line for line in before if line not in after]
    added = [line for line in after if line not in before]
    change = f"now `{added[0]}`" if added else f"no longer `{removed[0]}`" if removed else "order or comments"
    if added and removed:
        change += f", was `{removed[0]}`"
    raise ConfigError(
        f"{os.path.join(model_dir, name)} differs from this run's config ({change}); resume with the "
        "same configuration, pass --allow_config_change, or use a new --model_dir.")


@gin.configurable
def run_experiment(model_dir: str, mode: str = "train_and_eval", config_text: str = "",
                   allow_config_change: bool = False, task: Task = gin.REQUIRED, seed: int = 0,
                   deterministic: bool = False, precision: str = "float32", dry_run: bool = False) -> dict:
    """Runs one experiment as configured by gin; returns the result dict.

    Args:
      model_dir: where the run writes (and resumes from).
      mode: 'train', 'eval' (the latest checkpoint) or 'train_and_eval'.
      config_text: the gin files and bindings as given (written to config.gin).
      allow_config_change: resume even if config_text differs from config.gin.
      task: the Task (e.g. `@ClassificationTask()`).
      seed: initialisation and data order.
      deterministic: op determinism (same weights on rerun and on resume).
      precision: 'float32', 'mixed_bfloat16', 'mixed_float16' or 'auto' (measured: the fastest
        on this machine, cached; see expframe/replicator/auto_settings.py).
      dry_run: build everything a run builds before its first step (Replicator, Trainer,
        the task's model, optimizer and input pipelines), check a resume (the config
        and the checkpoint's shapes, read only), then return without training or
        writing anything into model_dir: {"dry_run": True, "step", "parsed_config", ...}.
    """
    if mode not in MODES:
        raise ConfigError(f"--mode={mode!r}: use one of {', '.join(MODES)}.")
    if not isinstance(seed, int):
        raise ConfigError(f"run_experiment.seed={seed!r} must be an integer.")
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    replicator = _gin_call(Replicator)
    keras.mixed_precision.set_global_policy(_precision_for(precision, replicator))
    trainer = _gin_call(Trainer)
    if not isinstance(task, Task):
        raise ConfigError(f"run_experiment.task must be a Task instance (e.g. @ClassificationTask()), got {task!r}.")
    try:
        # Builds the task's model, optimizer and data: most configurables are called here.
        _gin_call(lambda: trainer.prepare(replicator, task, seed, deterministic))

        parsed_config = gin.config_str()
        if not allow_config_change:
            _check_config_unchanged(model_dir, config_text, parsed_config)
            run_files.check_resolved(model_dir, run_files.resolved_choices(replicator))
        if dry_run:
            step = trainer.restore(os.path.join(model_dir, "checkpoints"))  # reads only
            if mode == "eval" and step == 0:
                raise ConfigError(f"--mode=eval but {model_dir}/checkpoints holds no checkpoint; train first.")
            return {"dry_run": True, "step": step, "parsed_config": parsed_config, "target": replicator.target,
                    "num_replicas": replicator.num_replicas, "global_batch_size": trainer.global_batch_size,
                    "train_steps": trainer.train_steps}
        out = RunFiles(model_dir, replicator.is_chief, replicator.worker_index)
        with cluster.lost_worker_is_a_run_error(replicator.num_workers, out.restore_dir):
            return _restore_and_run(trainer, replicator, out, model_dir, mode, config_text, parsed_config)
    finally:
        task.close()  # its processes (render workers, actors): on every exit path, signals included


def _restore_and_run(trainer: Trainer, replicator: Replicator, out: RunFiles, model_dir: str, mode: str,
                     config_text: str, parsed_config: str) -> dict:
    """Restores the newest checkpoint, then trains and/or evaluates; returns the result dict."""
    try:  # a checkpoint or metrics file that cannot be read fails here, before anything is written
        restore_started = time.monotonic()
        step = trainer.restore(out.checkpoint_dir, out.restore_dir)
        restore_s = time.monotonic() - restore_started
        if mode == "eval" and step == 0:
            raise ConfigError(f"--mode=eval but {out.checkpoint_dir} holds no checkpoint; train first.")
        if mode != "eval" and step < trainer.train_steps:
            trainer.trace()  # errors found only while tracing the step also leave the model_dir untouched
        out.start(config_text, step, parsed_config, run_files.resolved_choices(replicator))
    except BaseException:
        out.close()  # a non-chief worker's private directory
        raise
    started = provenance.record()
    out.log_provenance(step, started)  # every start: commit, versions, machine, load
    if step:
        out.progress(f"resuming from step {step} ({out.checkpoint_dir}; restored in {restore_s:.2f} s)")
    out.progress(f"model_dir {model_dir}: target '{replicator.target}', {replicator.num_replicas} replica(s), "
                 f"global batch {trainer.global_batch_size}, {trainer.train_steps} steps")
    try:
        if mode == "eval":
            summary = {"eval": trainer.run_eval(out, step), "step": step, "wall_time_s": 0.0}
        else:
            summary = trainer.train(out, evaluate=(mode == "train_and_eval"))
        if summary.get("preempted"):
            return summary
        result = {"step": summary["step"], "target": replicator.target, "num_replicas": replicator.num_replicas,
                  "global_batch_size": trainer.global_batch_size, "eval": summary["eval"],
                  "wall_time_s": round(summary["wall_time_s"], 3), "provenance": provenance.finished(started)}
        out.write_result(result)
        return result
    finally:
        out.close()
