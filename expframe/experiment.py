"""run_experiment: model_dir, seeds, precision, Replicator, Task, Trainer; nothing is
written into the model_dir until the whole configuration has been validated."""

import os
import re

import gin
import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator import Replicator
from expframe.run_files import RunFiles
from expframe.tasks.base import Task
from expframe.trainer import Trainer

MODES = ("train", "eval", "train_and_eval")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "auto")


def _precision_for(precision: str, target: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"run_experiment.precision={precision!r}: use one of {', '.join(PRECISIONS)}.")
    if precision != "auto":
        return precision
    if target == "tpu" or (target == "cpu" and _cpu_has_bfloat16()):
        return "mixed_bfloat16"
    return "mixed_float16" if target == "gpu" else "float32"


def _cpu_has_bfloat16() -> bool:
    """bfloat16 pays on CPUs with native bf16 matmuls (AVX512_BF16, AMX); elsewhere it is
    emulated and slower (measured: 50 GFLOP/s for both dtypes on an AVX2-only CPU)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _gin_call(fn, what: str):
    """Calls a configurable; gin's 'required binding' errors become ConfigErrors."""
    try:
        return fn()
    except ConfigError:
        raise
    except (ValueError, TypeError, RuntimeError) as e:
        text = str(e)
        missing = re.search(r"Required bindings for `?(\w+)`? not provided in config: \[(.*?)\]", text)
        if missing:
            names = ", ".join(f"{missing.group(1)}.{p.strip(chr(39))}" for p in missing.group(2).split(", "))
            raise ConfigError(f"{what}: missing binding(s) {names}; set them in the gin file or with --gin_param.") from None
        if "In call to configurable" in text or "takes" in text or "unexpected keyword" in text:
            raise ConfigError(f"{what}: {text.strip().splitlines()[0]}") from None
        raise


@gin.configurable
def run_experiment(model_dir: str, mode: str = "train_and_eval", config_text: str = "",
                   allow_config_change: bool = False, task: Task = gin.REQUIRED, seed: int = 0,
                   deterministic: bool = False, precision: str = "float32") -> dict:
    """Runs one experiment as configured by gin; returns the result dict.

    Args:
      model_dir: where the run writes (and resumes from).
      mode: 'train', 'eval' (the latest checkpoint) or 'train_and_eval'.
      config_text: the gin files and bindings as given (written to config.gin).
      allow_config_change: resume even if config_text differs from config.gin.
      task: the Task (e.g. `@ClassificationTask()`).
      seed: initialisation and data order.
      deterministic: op determinism (same weights on rerun and on resume).
      precision: 'float32', 'mixed_bfloat16', 'mixed_float16' or 'auto' (by target).
    """
    if mode not in MODES:
        raise ConfigError(f"--mode={mode!r}: use one of {', '.join(MODES)}.")
    if not isinstance(seed, int):
        raise ConfigError(f"run_experiment.seed={seed!r} must be an integer.")
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    replicator = _gin_call(Replicator, "Replicator")
    keras.mixed_precision.set_global_policy(_precision_for(precision, replicator.target))
    trainer = _gin_call(Trainer, "Trainer")
    if not isinstance(task, Task):
        raise ConfigError(f"run_experiment.task must be a Task instance (e.g. @ClassificationTask()), got {task!r}.")
    trainer.prepare(replicator, task, seed, deterministic)

    previous = RunFiles.existing_config(model_dir)
    if previous is not None and previous != config_text and not allow_config_change:
        raise ConfigError(
            f"{os.path.join(model_dir, 'config.gin')} differs from this run's config; resume with the "
            "same gin files and bindings, pass --allow_config_change, or use a new --model_dir.")
    out = RunFiles(model_dir, replicator.is_chief, replicator.worker_index)
    step = trainer.restore(out.checkpoint_dir, out.restore_dir)
    if mode == "eval" and step == 0:
        raise ConfigError(f"--mode=eval but {out.checkpoint_dir} holds no checkpoint; train first.")
    out.start(config_text, step)
    if step:
        out.progress(f"resuming from step {step} ({out.checkpoint_dir})")
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
                  "wall_time_s": round(summary["wall_time_s"], 3)}
        out.write_result(result)
        return result
    finally:
        out.close()
