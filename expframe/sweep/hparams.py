"""A study in TensorBoard's HParams dashboard: `tensorboard --logdir <study root>`.

Written with the table (`summary.write_summary`), from the same rows:

- `<root>/events.out.tfevents.*.hparams_config`: the experiment (`hp.hparams_config`):
  one HParam per swept binding (its name as swept, e.g. `Trainer.global_batch_size`,
  shown by its short name, with the values it takes) and one Metric per final
  metric of the table (`eval_top1`, `eval_loss`, ..., `examples_per_sec`);
- `<root>/<run>/hparams/`: per run that has a directory, its session: the run's swept
  values (`hp.hparams`, session group = the run's name, started when its first attempt
  started) and its final metrics as scalars at its final step, under the tags the
  experiment names, and how it ended (`session_end_info`): its status (`STATUS`: the
  summary's `ok` is success, `failed`, `config_error` and `crashed` failure,
  `unfinished` running) and, once it ended, when (its last attempt's end). TensorBoard
  pairs them because they are in the same run folder (`<run>/hparams`).

Every swept binding is marked `differs` in the experiment when it takes more than one
value (TensorBoard's dashboard shows such columns first).

Values are bool, int, float or str, as gin parses them (`'cpu'` is `cpu`); anything
else (a tuple, None, a `@reference`) is its gin text. A binding whose values mix types
is written as the gin text of each (ints and floats mixed are floats).

Each call rewrites both idempotently: a run's folder is written whole into a temporary
folder and swapped in, and the experiment's event file replaces the previous one.
"""

from __future__ import annotations

import ast
import datetime
import glob
import os
import shutil
import tempfile
from typing import Mapping, Optional, Sequence, Union

from expframe.sweep.runner import read_record
from expframe.sweep.spec import Study

DIR = "hparams"                  # <root>/<run>/hparams/: the run's session and metrics
SUFFIX = ".hparams_config"       # <root>/events.out.tfevents.*<SUFFIX>: the experiment
EXTRA_METRICS = ("examples_per_sec",)  # beside the eval_* columns

Value = Union[bool, int, float, str]
# The summary's status -> the name of TensorBoard's session status (api_pb2.Status); any
# other (stopped, stale, pending) is STATUS_UNKNOWN.
STATUS = {"ok": "STATUS_SUCCESS", "failed": "STATUS_FAILURE", "config_error": "STATUS_FAILURE",
          "crashed": "STATUS_FAILURE", "unfinished": "STATUS_RUNNING"}


def _literal(text: str) -> Value:
    """The value of one gin text as a bool, int, float or str; anything else its text."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text  # a @reference or %macro
    return value if isinstance(value, (bool, int, float, str)) else text


def domain_values(texts: Sequence[str]) -> dict[str, Value]:
    """Gin text -> HParams value for one swept binding's values, all of one type.

    Args:
      texts: the gin text of each value (distinct, as the study checks).

    Returns:
      Each text's value: as parsed when all are of one type (ints and floats
      mixed: floats), else the gin texts themselves (always distinct).
    """
    values = [_literal(t) for t in texts]
    types = {type(v) for v in values}
    if len(types) > 1 and types <= {int, float}:
        values = [float(v) for v in values]
    elif len(types) > 1:
        values = list(texts)
    if len(set(values)) < len(values):  # e.g. 1 and 1.0, or 'a' and "a"
        values = list(texts)
    return dict(zip(texts, values, strict=True))


def metric_tags(rows: Sequence[Mapping]) -> list[str]:
    """The table's final metrics that some run has: `eval_*`, then `examples_per_sec`."""
    def present(key: str) -> bool:
        return any(isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool) for row in rows)
    evals = sorted({k for row in rows for k in row if k.startswith("eval_") and present(k)})
    return evals + [k for k in EXTRA_METRICS if present(k)]


def _experiment(study: Study, tags: Sequence[str]):
    from tensorboard.plugins.hparams import api as hp  # pylint: disable=import-outside-toplevel
    keys = study.keys()
    hparams = []
    for axis in study.axes:
        for j, binding in enumerate(axis.bindings):
            values = domain_values([point[j] for point in axis.values])
            hparams.append(hp.HParam(binding, hp.Discrete(list(values.values())), display_name=keys[binding],
                                     description=f"swept by {axis.origin}"))
    metrics = [hp.Metric(tag, display_name=tag.removeprefix("eval_"), description=f"the summary's {tag}")
               for tag in tags]
    return hparams, metrics


def _experiment_pb(hparams: list, metrics: list, differs: set):
    """`hp.hparams_config_pb` with `differs` set on the HParams named in `differs`."""
    from tensorboard.plugins.hparams import plugin_data_pb2, summary_v2  # pylint: disable=import-outside-toplevel
    summary = summary_v2.hparams_config_pb(hparams=hparams, metrics=metrics)
    data = plugin_data_pb2.HParamsPluginData.FromString(summary.value[0].metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in differs
    summary.value[0].metadata.plugin_data.content = data.SerializeToString()
    return summary


def _write_experiment(root: str, hparams: list, metrics: list, differs: set) -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    old = glob.glob(os.path.join(root, f"events.out.tfevents.*{SUFFIX}"))
    tmp = tempfile.mkdtemp(prefix=".hparams_tmp_", dir=root)
    try:
        writer = tf.summary.create_file_writer(tmp, filename_suffix=SUFFIX)
        with writer.as_default():
            tf.summary.experimental.write_raw_pb(_experiment_pb(hparams, metrics, differs).SerializeToString(), step=0)
        writer.close()
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(root, name))
        for path in old:
            os.remove(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def session_times(root: str, run: str) -> tuple[Optional[float], Optional[float]]:
    """(start, end) of a run in seconds since the epoch, from the study's record of its
    attempts (`logs/<run>.json`): its first attempt's start and its last attempt's end;
    (None, None) for a run the study did not start (e.g. run by Slurm)."""
    attempts = read_record(root, run)["attempts"]
    if not attempts:
        return None, None
    def start(attempt):
        return datetime.datetime.fromisoformat(attempt["started"]).timestamp()
    return start(attempts[0]), start(attempts[-1]) + float(attempts[-1]["wall_time_s"])


def _write_session(root: str, row: Mapping, values: Mapping[str, Value], tags: Sequence[str]) -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorboard.plugins.hparams import api as hp  # pylint: disable=import-outside-toplevel
    from tensorboard.plugins.hparams import api_pb2, summary  # pylint: disable=import-outside-toplevel
    target = os.path.join(root, row["run"], DIR)
    tmp = tempfile.mkdtemp(prefix=".hparams_tmp_", dir=root)
    old = tmp + "_old"
    started, ended = session_times(root, row["run"])
    status = STATUS.get(row.get("status"), "STATUS_UNKNOWN")
    try:
        writer = tf.summary.create_file_writer(tmp)
        with writer.as_default(step=int(row.get("step") or 0)):
            hp.hparams(dict(values), trial_id=row["run"], start_time_secs=started)
            for tag in tags:
                value = row.get(tag)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    tf.summary.scalar(tag, float(value))
            end = None if status == "STATUS_RUNNING" else ended
            tf.summary.experimental.write_raw_pb(
                summary.session_end_pb(api_pb2.Status.Value(status), end_time_secs=end).SerializeToString(),
                step=int(row.get("step") or 0))
        writer.close()
        if os.path.isdir(target):
            os.rename(target, old)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_hparams(study: Study, root: str, rows: Sequence[Mapping]) -> list[str]:
    """Writes the study's HParams summaries (see the module docstring).

    Args:
      study: the study.
      root: its root directory (it exists: the table is written there first).
      rows: `summary.collect`'s rows, one per run, in the study's order.

    Returns:
      The run folders written (`<root>/<run>/hparams`); runs without a directory
      (not started) get none.
    """
    tags = metric_tags(rows)
    hparams, metrics = _experiment(study, tags)
    differs = {binding for axis in study.axes for j, binding in enumerate(axis.bindings)
               if len({point[j] for point in axis.values}) > 1}
    _write_experiment(root, hparams, metrics, differs)
    by_binding = {binding: domain_values([point[j] for point in axis.values])
                  for axis in study.axes for j, binding in enumerate(axis.bindings)}
    written = []
    by_name = {row["run"]: row for row in rows}
    for run in study.runs():
        row = by_name.get(run.name)
        if row is None or not os.path.isdir(os.path.join(root, run.name)):
            continue
        _write_session(root, row, {b: by_binding[b][text] for b, text in run.values}, tags)
        written.append(os.path.join(root, run.name, DIR))
    return written
