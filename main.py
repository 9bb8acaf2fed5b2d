"""expframe entry point: flags -> gin -> run_experiment.

    python main.py --gin_file=experiments/quickstart.gin [--gin_param='Trainer.train_steps=100'] [--model_dir=DIR]

Exit status: 0 success, 2 configuration error (one line on stderr), 1 failure during the run.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

flags.DEFINE_multi_string("gin_file", [], "Gin file(s) describing the experiment (repeatable).")
flags.DEFINE_multi_string("gin_param", [], "Gin binding(s), applied after the files (repeatable).")
flags.DEFINE_string("model_dir", None, "Where the run writes and resumes from (default: runs/<experiment>).")
flags.DEFINE_enum("mode", "train_and_eval", ["train", "eval", "train_and_eval"], "What to run.")
flags.DEFINE_bool("allow_config_change", False, "Resume even if the config differs from model_dir/config.gin.")
FLAGS = flags.FLAGS


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def parse_flags(argv):
    """absl's flag parsing, but a bad flag is a configuration error: one line, exit 2."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        message = " ".join(str(e).split()).replace(" ?", "?").rstrip(".")
        sys.exit(_error(f"{message}; see `python main.py --helpfull`."))


def main(argv):
    if len(argv) > 1:
        return _error(f"unexpected arguments {argv[1:]}; pass settings with --gin_param")
    logging.set_verbosity(logging.WARNING)  # TensorFlow's Python INFO lines drown the progress
    from expframe import config, errors, experiment  # pylint: disable=import-outside-toplevel
    if not FLAGS.gin_file:
        return _error("--gin_file is required (e.g. --gin_file=experiments/quickstart.gin)")
    model_dir = FLAGS.model_dir or os.path.join("runs", os.path.splitext(os.path.basename(FLAGS.gin_file[0]))[0])
    try:
        text = config.parse(FLAGS.gin_file, FLAGS.gin_param)
        experiment.run_experiment(model_dir=model_dir, mode=FLAGS.mode, config_text=text,
                                  allow_config_change=FLAGS.allow_config_change)
    except (errors.ConfigError, errors.RunError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        if isinstance(e, errors.WorkerLostError):  # TensorFlow's teardown would wait for the lost peer
            from expframe.replicator import cluster  # pylint: disable=import-outside-toplevel
            cluster.exit_now(e.exit_code)
        return e.exit_code
    except (TypeError, ValueError, RuntimeError) as e:
        # gin builds run_experiment's arguments (the task) before its body runs.
        error = config.config_error_from(e)
        if error is None:
            raise
        return _error(str(error))
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
