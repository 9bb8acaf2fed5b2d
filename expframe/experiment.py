"""run_experiment: model_dir, seeds, precision, Replicator, Task, Trainer; nothing is
written into the model_dir until the whole configuration has been validated.

Each mode drives the same Trainer (and its Evaluator and Checkpointer) another way:

  train, train_and_eval   the train loop (evaluating on its cadence for train_and_eval)
  eval                    one evaluation of a checkpoint (--checkpoint: latest, best or a step)
  continuous_eval         every new checkpoint as a trainer writes it (expframe/continuous_eval.py)
  export                  a SavedModel of a checkpoint for serving (expframe/export.py)

The last three read the model_dir: they never rewrite a file the trainer writes, only
append to metrics.jsonl (and TensorBoard), or write elsewhere (the export). The last
two run on a local target: a run bound to a cluster (multi_worker, parameter_server,
tpu) is evaluated or exported on this host's GPU or CPU, one replica.
"""

import json
import os
import time
from typing import Any, Dict, Optional, Sequence

import gin
import keras
import tensorflow as tf

from expframe import best_checkpoint, dir_lock, epochs, evaluator, gin_errors, init_checkpoint, provenance, run_files
from expframe.checkpointer import checkpoints_in, read_checkpoint
from expframe.continuous_eval import ContinuousEvaluator
from expframe.errors import ConfigError, RunError
from expframe.replicator import Replicator, auto_settings, cluster, reserve_inter_op_threads, split_only_for
from expframe.run_files import RunFiles
from expframe.tasks.base import Task
from expframe.trainer import Trainer

MODES = ("train", "eval", "train_and_eval", "continuous_eval", "export")
READERS = ("eval", "continuous_eval", "export")  # read the model_dir; never rewrite the trainer's files
PRECISIONS = auto_settings.PRECISIONS
_CLUSTER_TARGETS = ("multi_worker", "parameter_server", "tpu")


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


def _size_the_cpu(task: Any) -> None:
    """Before the Replicator: a `cpu` target splits the CPU into only the replicas it binds
    (this process builds no larger one), and its inter-op pool gets the threads the task's
    host-side services hold (Task.host_threads). Both take effect when TensorFlow starts."""
    if isinstance(task, Task):
        reserve_inter_op_threads(task.host_threads)
    bindings = gin.get_bindings(Replicator)
    replicas = bindings.get("num_replicas")
    if bindings.get("target", "cpu") == "cpu":
        split_only_for(replicas if isinstance(replicas, int) and replicas > 0 else 1)


def _local_replicator(mode: str) -> Replicator:
    """The run's Replicator; for continuous_eval and export a local one (module docstring):
    the bound target unless it needs a cluster, and for export one replica (a mesh stays a
    mesh: its model is laid out on it)."""
    target = gin.get_bindings(Replicator).get("target", "cpu")
    if mode == "export" and target != "mesh" or mode == "continuous_eval" and target in _CLUSTER_TARGETS:
        local = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
        return Replicator(target=local, num_replicas=1)
    return Replicator()


def _recorded_precision(model_dir: str, precision: str, replicator: Replicator) -> str:
    """An evaluator computes in the precision its trainer recorded (resolved.json), else as bound."""
    path = os.path.join(model_dir, run_files.RESOLVED)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)["run_experiment.precision"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return _precision_for(precision, replicator)


def _choose_checkpoint(model_dir: str, checkpoint: str) -> str:
    """The checkpoint prefix that --checkpoint names: 'latest', 'best' or a step."""
    folder = os.path.join(model_dir, "checkpoints")
    if checkpoint == "best":
        path = best_checkpoint.path_of(model_dir)
        if path is None:
            raise ConfigError(f"--checkpoint=best but {model_dir} keeps no best checkpoint (bind "
                              "Trainer.best_checkpoint = ('top1', 'max') or the like, and evaluate while training).")
        return path
    found = checkpoints_in(folder) if os.path.isdir(folder) else []
    if checkpoint == "latest":
        if not found:
            raise ConfigError(f"{folder} holds no checkpoint; train first.")
        return found[0][1]
    if not str(checkpoint).isdigit() or int(checkpoint) not in dict(found):
        steps = ", ".join(str(s) for s, _ in sorted(found)) or "none"
        raise ConfigError(f"--checkpoint={checkpoint!r}: use latest, best or the step of a checkpoint in {folder} "
                          f"(there: {steps}).")
    return dict(found)[int(checkpoint)]


@gin.configurable
def run_experiment(model_dir: str, mode: str = "train_and_eval", config_text: str = "",
                   allow_config_change: bool = False, task: Task = gin.REQUIRED, seed: int = 0,
                   deterministic: bool = False, precision: str = "float32", dry_run: bool = False,
                   init_checkpoint: Optional[str] = None, init_include: Optional[Sequence[str]] = None,
                   init_exclude: Sequence[str] = (), checkpoint: str = "latest",
                   export_dir: Optional[str] = None, export_precision: str = "float32",
                   eval_timeout_s: float = 3600.0, evaluations: Sequence[str] = ()) -> dict:
    """Runs one experiment as configured by gin; returns the result dict.

    Args:
      model_dir: where the run writes (and resumes from).
      mode: one of MODES (module docstring).
      config_text: the gin files and bindings as given (written to config.gin).
      allow_config_change: resume even if config_text differs from config.gin.
      task: the Task (e.g. `@ClassificationTask()`).
      seed: initialisation and data order.
      deterministic: op determinism (same weights on rerun and on resume).
      precision: 'float32', 'mixed_bfloat16', 'mixed_float16' or 'auto' (measured: the fastest
        on this machine, cached; see expframe/replicator/auto_settings.py).
      dry_run: build everything a run builds before its first step (Replicator, Trainer,
        the task's model, optimizer and input pipelines), check a resume (the config
        and the checkpoint's shapes, read only) and an init_checkpoint, then return
        without training or writing anything into model_dir: {"dry_run": True, "step",
        "parsed_config", ...}.
      init_checkpoint, init_include, init_exclude: start a new run (step 0) from another
        run's weights (expframe/init_checkpoint.py).
      checkpoint: for eval and export: 'latest', 'best' or a step (--checkpoint).
      export_dir: for export: where the SavedModel goes (default model_dir/export/step_N).
      export_precision: for export: the Keras policy the exported model computes in.
      eval_timeout_s: for continuous_eval: stop after this long with no new checkpoint.
      evaluations: for eval: the evaluations to run (`eval`, the run's own, or the names
        the task binds, e.g. `eval_train`); empty: all of them (--evaluation).
    """
    if mode not in MODES:
        raise ConfigError(f"--mode={mode!r}: use one of {', '.join(MODES)}.")
    if not isinstance(seed, int):
        raise ConfigError(f"run_experiment.seed={seed!r} must be an integer.")
    if evaluations and mode != "eval":
        raise ConfigError(f"--evaluation={evaluations[0]} is for --mode=eval (--mode={mode} runs every evaluation "
                          "the run binds); drop it or pass --mode=eval.")
    if mode != "export":  # found now, dry runs included: not after minutes of building
        run_files.check_writable(model_dir)
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    _size_the_cpu(task)
    replicator = _gin_call(lambda: _local_replicator(mode))
    if mode not in READERS and replicator.is_chief and not _lock_wait_s():
        # At once, not after the build; the lock itself is taken before the first write. Only
        # the chief: the other workers of its cluster run beside it, and a restarted job waits.
        _refuse_a_live_writer(model_dir)
    if mode == "export":
        if export_precision not in PRECISIONS or export_precision == "auto":
            raise ConfigError(f"--export_precision={export_precision!r}: use one of float32, mixed_bfloat16, "
                              "mixed_float16.")
        policy = export_precision
    elif mode in READERS:
        policy = _recorded_precision(model_dir, precision, replicator)
    else:
        policy = _precision_for(precision, replicator)
    keras.mixed_precision.set_global_policy(policy)
    trainer = _gin_call(Trainer)
    if not isinstance(task, Task):
        raise ConfigError(f"run_experiment.task must be a Task instance (e.g. @ClassificationTask()), got {task!r}.")
    try:
        # Builds the task's model, optimizer and data: most configurables are called here.
        _gin_call(lambda: trainer.prepare(replicator, task, seed, deterministic))

        parsed_config = gin.config_str()
        trainer.evaluator.check_names(evaluations)  # --evaluation: names the task binds

        def check_config() -> None:
            if not allow_config_change:
                _check_config_unchanged(model_dir, config_text, parsed_config)

        check_config()
        if not allow_config_change and mode not in READERS:
            run_files.check_resolved(model_dir, {**run_files.resolved_choices(replicator), **trainer.resolved_steps})
        init = (init_checkpoint, init_include, init_exclude)
        if dry_run:
            step = trainer.restore(os.path.join(model_dir, "checkpoints"))  # reads only
            if mode in READERS and mode != "continuous_eval":
                _choose_checkpoint(model_dir, checkpoint)
            elif mode not in READERS and step == 0 and init_checkpoint is not None:
                _initialise(trainer, replicator, *init)
            return {"dry_run": True, "step": step, "parsed_config": parsed_config, "target": replicator.target,
                    "num_replicas": replicator.num_replicas, "global_batch_size": trainer.global_batch_size,
                    "train_steps": trainer.train_steps}
        out = RunFiles(model_dir, replicator.is_chief, replicator.worker_index)
        if mode == "continuous_eval":
            return _continuous_eval(trainer, out, eval_timeout_s, check_config)
        if mode == "export":
            return _export(trainer, model_dir, checkpoint, export_dir)
        if mode == "eval":
            return _eval(trainer, replicator, out, checkpoint, evaluations)
        with cluster.lost_worker_is_a_run_error(replicator.num_workers, out.restore_dir):
            return _restore_and_train(trainer, replicator, out, model_dir, mode, config_text, parsed_config, init,
                                      allow_config_change)
    finally:
        task.close()  # its processes (render workers, actors): on every exit path, signals included


def _initialise(trainer: Trainer, replicator: Replicator, source: str, include, exclude) -> None:
    """A new run's start from another run's weights (init_checkpoint); prints what was taken."""
    report = init_checkpoint.restore(trainer.task.trackables(), source, include, exclude or (), replicator)
    if replicator.is_chief:
        print(init_checkpoint.summary(report), flush=True)


def _refuse_a_live_writer(model_dir: str) -> None:
    if dir_lock.is_held(os.path.join(model_dir, dir_lock.WRITER)):
        raise ConfigError(dir_lock.writer_held(model_dir))


def _lock_wait_s() -> float:
    return dir_lock.writer_wait_s()


def _hold_the_writer_lock(out: RunFiles) -> Optional[dir_lock.Lock]:
    """The chief's lock on its model_dir (dir_lock: `.writer.lock`); other workers write
    only their private directories and take none. A ConfigError if another trainer holds it."""
    if not out.is_chief:
        return None
    os.makedirs(out.model_dir, exist_ok=True)
    path = os.path.join(out.model_dir, dir_lock.WRITER)
    lock = dir_lock.hold_waiting(path, _lock_wait_s(), out.progress)
    if lock is None:
        raise ConfigError(dir_lock.writer_held(out.model_dir))
    return lock


def _complete(out: RunFiles, trainer: Trainer, step: int) -> Optional[dict]:
    """The result of a run that already finished (its final checkpoint and result.json), else None."""
    path = os.path.join(out.shared_dir, "result.json")  # every worker decides alike
    if step < trainer.train_steps or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _restore_and_train(trainer: Trainer, replicator: Replicator, out: RunFiles, model_dir: str, mode: str,
                       config_text: str, parsed_config: str, init: tuple, allow_config_change: bool) -> dict:
    """Restores the newest checkpoint (or, for a new run, the init_checkpoint), then trains.
    It holds the model_dir's writer lock from before its first write to its end. A finished
    run is left as it is, unless its configuration may change (allow_config_change): then
    it runs its end again (the final evaluation and result.json, with the new settings)."""
    lock, fresh = None, out.is_chief and not os.path.exists(model_dir)
    try:  # a checkpoint or metrics file that cannot be read fails here, before anything is written
        restore_started = time.monotonic()
        step = trainer.restore(out.checkpoint_dir, out.restore_dir)
        restore_s = time.monotonic() - restore_started
        done = None if allow_config_change else _complete(out, trainer, step)
        if done is not None:
            out.progress(f"the run in {model_dir} is complete (step {step} of {trainer.train_steps}, result.json): "
                         "nothing to do; --mode=eval evaluates it again, --allow_config_change runs its end "
                         "again (with a larger Trainer.train_steps, trains on)")
            return done
        if step == 0 and init[0] is not None:
            _initialise(trainer, replicator, *init)
        if step < trainer.train_steps:
            trainer.trace()  # errors found only while tracing the step also leave the model_dir untouched
        with run_files.disk_errors("the writer lock", model_dir, step):
            lock = _hold_the_writer_lock(out)
        newest = checkpoints_in(out.restore_dir)[:1] if os.path.isdir(out.restore_dir) else []
        if lock is not None and newest and newest[0][0] != step:  # the last holder saved more meanwhile
            step = trainer.restore(out.checkpoint_dir, out.restore_dir)
        resolved = {**run_files.resolved_choices(replicator), **trainer.resolved_steps}
        out.start(config_text, step, parsed_config, resolved, own_eval=(mode == "train_and_eval"))
        started = provenance.record()
        out.log_provenance(step, started)  # every start: commit, versions, machine, load
    except BaseException:
        out.close()  # a non-chief worker's private directory
        if fresh and lock is not None:  # a start that failed (a full disk, a signal) leaves no new run behind;
            run_files.remove_start(model_dir)  # only the lock's holder: a refused second trainer touches nothing
        elif fresh and os.path.isdir(model_dir) and not os.listdir(model_dir):
            os.rmdir(model_dir)  # made for a lock that could not be taken (only if still empty)
        if lock is not None:
            lock.release()
        raise
    if step:
        out.progress(f"resuming from step {step} ({out.checkpoint_dir}; restored in {restore_s:.2f} s)")
    out.progress(f"model_dir {model_dir}: target '{replicator.target}', {replicator.num_replicas} replica(s), "
                 f"global batch {trainer.global_batch_size}, "
                 f"{epochs.describe(trainer.train_steps, trainer.train_epochs, trainer.steps_per_epoch)}")
    try:
        summary = trainer.train(out, evaluate=(mode == "train_and_eval"))
        if summary.get("preempted"):
            return summary
        result = {"step": summary["step"], "target": replicator.target, "num_replicas": replicator.num_replicas,
                  "global_batch_size": trainer.global_batch_size, "eval": summary["eval"],
                  **out.finish_segment(summary["step"]), "provenance": provenance.finished(started)}
        out.write_result(result)
        return result
    finally:
        out.close()
        if lock is not None:
            lock.release()


def _restore_chosen(trainer: Trainer, model_dir: str, checkpoint: str,
                    objects: Optional[Dict[str, Any]] = None) -> int:
    path = _choose_checkpoint(model_dir, checkpoint)
    cause = read_checkpoint(trainer.evaluation_objects() if objects is None else objects, path)
    if cause is not None:
        raise RunError(f"cannot read the checkpoint {path}: {cause}")
    return int(trainer.step.numpy())


def _eval(trainer: Trainer, replicator: Replicator, out: RunFiles, checkpoint: str,
          evaluations: Sequence[str]) -> dict:
    """On-demand evaluations of the chosen checkpoint (--mode=eval), recorded apart from the
    run's curves (`RunFiles.log_on_demand`): a reader, it rewrites none of the trainer's
    files and adds no record to a curve, so a curve keeps one record per step, in order."""
    names = trainer.evaluator.check_names(evaluations) if evaluations else trainer.evaluator.names()
    if checkpoint == "latest":
        step = trainer.restore(out.checkpoint_dir, out.restore_dir)
        if step == 0:
            raise ConfigError(f"--mode=eval but {out.checkpoint_dir} holds no checkpoint; train first.")
    else:
        step = _restore_chosen(trainer, out.shared_dir, checkpoint)
    out.start_reading()
    out.progress(f"evaluating step {step} (--checkpoint={checkpoint}) on target '{replicator.target}', "
                 f"{replicator.num_replicas} replica(s): {', '.join(names)}; recorded in "
                 f"{out.metrics_path} as split '{run_files.ON_DEMAND}'")
    started = time.time()
    try:
        results = {name: m for name, m in trainer.evaluator.evaluate_all(step, names).items() if m}
        out.log_on_demand(step, checkpoint, results)
        for name, metrics in results.items():
            out.progress("{} at step {}: {}".format(name, step, "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())))
        return {"eval": results.get(evaluator.MAIN, {}), "evaluations": results, "step": step,
                "wall_time_s": round(time.time() - started, 3)}
    finally:
        out.close()


def _continuous_eval(trainer: Trainer, out: RunFiles, timeout_s: float, check_config) -> dict:
    out.start_reading()
    out.log_provenance(0, provenance.record())
    try:
        return ContinuousEvaluator(trainer, out, timeout_s, check_config=check_config).run()
    finally:
        out.close()


def _export(trainer: Trainer, model_dir: str, checkpoint: str, export_dir: Optional[str]) -> dict:
    """A SavedModel of the chosen checkpoint, written outside the trainer's files."""
    from expframe import export  # pylint: disable=import-outside-toplevel
    # The weights, not the optimizers: their state depends on the precision (export.restorable).
    step = _restore_chosen(trainer, model_dir, checkpoint, export.restorable(trainer.task, trainer.step))
    name = f"best_step_{step}" if checkpoint == "best" else f"step_{step}"
    export_dir = export_dir or os.path.join(model_dir, "export", name)
    info = export.export_saved_model(trainer.task, export_dir)
    keras_copy = f"; Keras copy {export.KERAS_FILE}" if info["keras_model"] else ""
    print(f"exported step {step} ({checkpoint}) to {export_dir}: signatures {', '.join(sorted(info['signatures']))}"
          f"{keras_copy}", flush=True)
    return {"step": step, "export_dir": export_dir, **info}
