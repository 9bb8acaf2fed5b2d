"""The command line of a run: `python main.py ...`, `python -m expframe ...` and the
installed `expframe` command are the same program.

    expframe --gin_file=experiments/quickstart.gin [--gin_param='Trainer.train_steps=100'] [--model_dir=DIR]
    expframe --gin_file=quickstart --dry_run          # parse, build, check; train and write nothing
    expframe --list_configurables [--gin_file=F]      # every configurable, its parameters and defaults

Exit status: 0 success (or a checkpoint saved on SIGTERM/SIGINT during training), 2
configuration error (one line on stderr), 1 failure during the run, 128 + signal for
a SIGINT before the first training step (one line: nothing was trained).
"""

import os
import sys

from absl import app, flags, logging

from expframe import interrupts, tf_noise

flags.DEFINE_multi_string("gin_file", [], "Gin file(s) describing the experiment (repeatable): a path, or the "
                          "name of a shipped experiment (`quickstart` is experiments/quickstart.gin).")
flags.DEFINE_multi_string("gin_param", [], "Gin binding(s), applied after the files (repeatable).")
flags.DEFINE_multi_string("gin_search_path", [], "Folder(s) searched for gin files, includes and the Python "
                          "modules that gin files import, after the gin file's own folder (repeatable; also "
                          "$EXPFRAME_GIN_PATH, then PYTHONPATH).")
flags.DEFINE_string("model_dir", None, "Where the run writes and resumes from (default: runs/<experiment>).")
flags.DEFINE_enum("mode", "train_and_eval", ["train", "eval", "train_and_eval", "continuous_eval", "export"],
                  "What to run: train (and evaluate: train_and_eval); evaluate a checkpoint (eval); evaluate each "
                  "new checkpoint as a trainer writes it (continuous_eval); write a SavedModel (export). See "
                  "docs/after_training.md.")
flags.DEFINE_string("checkpoint", "latest", "For --mode=eval and export: which checkpoint: latest, best (kept by "
                    "Trainer.best_checkpoint) or a step.")
flags.DEFINE_multi_string("evaluation", [], "For --mode=eval: which evaluation(s) to run (repeatable): eval (the "
                          "run's own, on its eval split) or a named one the task binds (e.g. eval_train: "
                          "ClassificationTask.evaluations); default all. Recorded apart from the run's curves.")
flags.DEFINE_string("export_dir", None, "For --mode=export: where the SavedModel goes (default "
                    "<model_dir>/export/step_<N>); it must not exist yet.")
flags.DEFINE_enum("export_precision", "float32", ["float32", "mixed_bfloat16", "mixed_float16"],
                  "For --mode=export: the precision the exported model computes in.")
flags.DEFINE_float("eval_timeout_s", 3600.0, "For --mode=continuous_eval: stop after this many seconds without "
                   "a new checkpoint.")
flags.DEFINE_bool("allow_config_change", False, "Resume even if this run's configuration differs from the one "
                  "the model_dir was run with (model_dir/parsed_config.gin: what the gin files and bindings "
                  "parse to).")
flags.DEFINE_bool("dry_run", False, "Parse the gin files and bindings, build everything a run builds before its "
                  "first step (model, optimizer, input pipelines; a missing generated dataset such as `shapes` is "
                  "generated, as on a first run), check a resume against model_dir (read only), print the parsed "
                  "config and exit: nothing is trained and nothing is written into the model_dir.")
flags.DEFINE_bool("list_configurables", False, "List every gin configurable with its parameters and defaults "
                  "(with --gin_file, also those of the modules the files import), then exit.")
flags.DEFINE_bool("tf_logs", False, "Show all of TensorFlow's log output: the start-up lines hidden by default "
                  "(CUDA probing on a machine without GPUs, CPU-feature notices, absl banners) and INFO lines.")
FLAGS = flags.FLAGS

_HELP = ("--help", "-h", "-?", "--helpshort", "--nohelp=false")


def prog() -> str:
    """How the user started this program, for messages (`python main.py`, `expframe`, ...)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "expframe"
    if name == "__main__.py":
        return "python -m expframe"
    return f"python {name}" if name.endswith(".py") else name


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _help(full: bool) -> None:
    """--help (this program's flags) or --helpfull (every flag), on stdout, exit 0."""
    print((__doc__ or "").replace("expframe --", f"{prog()} --", 3).strip() + "\n")
    print(FLAGS.get_help() if full else "flags:\n" + FLAGS.module_help(__name__))
    if not full:
        print("\nTry --helpfull for every flag (absl's too); --list_configurables for the gin configurables.")
    sys.exit(0)


def parse_flags(argv):
    """absl's flag parsing, but a bad flag is a configuration error (one line, exit 2)
    and --help exits 0."""
    if any(a in _HELP for a in argv[1:]):
        _help(full=False)
    if "--helpfull" in argv[1:]:
        _help(full=True)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        message = " ".join(str(e).split()).replace(" ?", "?").rstrip(".")
        sys.exit(_error(f"{message}; see `{prog()} --help`."))


def _start_tensorflow() -> None:
    """Imports TensorFlow and probes its devices (where CUDA prints its notices), with the
    start-up noise filtered unless --tf_logs."""
    if FLAGS.tf_logs:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        logging.set_verbosity(logging.INFO)
    else:
        logging.set_verbosity(logging.WARNING)  # TensorFlow's Python INFO lines drown the progress
    with tf_noise.quiet_start(enabled=not FLAGS.tf_logs):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.config.list_physical_devices()
        from expframe import experiment  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import


def _check_files() -> int:
    """The checks that need no TensorFlow, made before it is imported (which takes seconds):
    --gin_file given, the search path's folders and every --gin_file found. 0 when they
    pass, else the exit status after the one-line error (bad flags fail earlier, in
    `parse_flags`)."""
    from expframe import errors, gin_paths  # pylint: disable=import-outside-toplevel
    if not FLAGS.gin_file and not FLAGS.list_configurables:
        return _error("--gin_file is required (e.g. --gin_file=experiments/quickstart.gin, or the name of a "
                      f"shipped experiment: --gin_file=quickstart); see `{prog()} --help`")
    try:
        gin_paths.add_search_path(FLAGS.gin_search_path)
        for path in FLAGS.gin_file:
            gin_paths.resolve(path)
    except errors.ConfigError as e:
        return _error(str(e).strip().splitlines()[0])
    return 0


def _model_dir() -> str:
    """--model_dir, or the default: runs/<the first gin file's name>."""
    return FLAGS.model_dir or os.path.join("runs", os.path.splitext(os.path.basename(FLAGS.gin_file[0]))[0])


def _check_locks() -> int:
    """A live trainer or continuous evaluator of the model_dir refuses a second one at once,
    before TensorFlow's import (seconds) and the build (up to minutes): 0 when free, else
    the exit status after the one-line error. The trainer and the evaluator take their
    locks later, before they write (a second one that started meanwhile is refused there)."""
    from expframe import dir_lock  # pylint: disable=import-outside-toplevel
    if FLAGS.list_configurables:
        return 0
    model_dir = _model_dir()
    if FLAGS.mode == "continuous_eval" and dir_lock.is_held(os.path.join(model_dir, dir_lock.EVALUATOR)):
        return _error(dir_lock.evaluator_held(model_dir))
    if (FLAGS.mode in ("train", "train_and_eval") and dir_lock.is_chief_by_environment()
            and not dir_lock.writer_wait_s() and dir_lock.is_held(os.path.join(model_dir, dir_lock.WRITER))):
        return _error(dir_lock.writer_held(model_dir))
    return 0


def _run(argv) -> int:
    if len(argv) > 1:
        return _error(f"unexpected arguments {argv[1:]}; pass settings with --gin_param")
    code = _check_files() or _check_locks()
    if code:
        return code
    _start_tensorflow()
    from expframe import config, configurable_list, errors, experiment, gin_errors  # noqa: E501  pylint: disable=import-outside-toplevel
    try:
        text = config.parse(FLAGS.gin_file, FLAGS.gin_param)
        if FLAGS.list_configurables:
            print(configurable_list.format_list(configurable_list.configurables()))
            return 0
        model_dir = _model_dir()
        result = experiment.run_experiment(
            model_dir=model_dir, mode=FLAGS.mode, config_text=text, allow_config_change=FLAGS.allow_config_change,
            dry_run=FLAGS.dry_run, checkpoint=FLAGS.checkpoint, export_dir=FLAGS.export_dir,
            export_precision=FLAGS.export_precision, eval_timeout_s=FLAGS.eval_timeout_s,
            evaluations=FLAGS.evaluation)
    except (errors.ConfigError, errors.RunError) as e:
        line = str(e).strip().splitlines()[0]
        # A configuration error that names a binding says where it was bound (file and line).
        print(f"error: {gin_errors.located(line) if isinstance(e, errors.ConfigError) else line}", file=sys.stderr)
        if isinstance(e, errors.WorkerLostError):  # TensorFlow's teardown would wait for the lost peer
            from expframe.replicator import cluster  # pylint: disable=import-outside-toplevel
            cluster.exit_now(e.exit_code)
        return e.exit_code
    except (TypeError, ValueError, RuntimeError) as e:
        # gin builds run_experiment's arguments (the task) before its body runs.
        error = gin_errors.config_error_from(e)
        if error is None:
            raise
        return _error(str(error))
    if FLAGS.dry_run:
        _print_dry_run(model_dir, result)
    return 0


def _print_dry_run(model_dir: str, result: dict) -> None:
    print("# dry run: the configuration as parsed (what model_dir/parsed_config.gin would hold)")
    print(result["parsed_config"].rstrip())
    start = f"resume from step {result['step']}" if result["step"] else "start at step 0"
    print(f"dry run: the configuration is valid: target '{result['target']}', {result['num_replicas']} replica(s), "
          f"global batch {result['global_batch_size']}, {result['train_steps']} steps; {model_dir} would {start}. "
          "Nothing was trained and nothing was written into the model_dir.", flush=True)


def _main(argv) -> int:
    try:
        return _run(argv)
    except interrupts.StartupInterrupt as e:
        return interrupts.report(e)


def main() -> None:
    """Entry point of `main.py`, `python -m expframe` and the `expframe` command."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    interrupts.arm()  # Ctrl-C works from the first moment (see expframe/interrupts.py)
    try:
        app.run(_main, flags_parser=parse_flags)
    except interrupts.StartupInterrupt as e:  # while absl parsed the flags
        sys.exit(interrupts.report(e))


if __name__ == "__main__":
    main()
