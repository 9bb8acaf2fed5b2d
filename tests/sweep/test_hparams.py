"""The study in TensorBoard's HParams dashboard (expframe/sweep/hparams.py), from runs of the
fake main.py: what the event files hold, read back as TensorBoard reads them."""

import datetime
import glob
import os

import pytest
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins.hparams import api_pb2, metadata
from tensorboard.util import tensor_util

from expframe.sweep import hparams, runner, spec, summary
from tests.sweep.test_runner import FAKE_MAIN

SEED, BATCH, LR, SIZE = ("run_experiment.seed", "Trainer.global_batch_size", "keras.optimizers.Adam.learning_rate",
                         "shapes_input.image_size")


@pytest.fixture(scope="module")
def study_root(tmp_path_factory):
    """Batch 16/32 zipped with a learning rate (32 fails: no eval) and a tuple, x 2 seeds, run by the
    fake main.py; a third zip point never started (its directory is removed)."""
    study = spec.build_study(gin_files=["experiments/quickstart.gin"], sweeps=["run_experiment.seed=[0, 1]"],
                             zips=["Trainer.global_batch_size=[16, 32, 64]",
                                   "keras.optimizers.Adam.learning_rate=[1e-3, 1e30, 4e-3]",
                                   "shapes_input.image_size=[(32, 32), (32, 32, 3), 64]"])
    root = str(tmp_path_factory.mktemp("hparams") / "study")
    runner.run_study(study, root, main_py=FAKE_MAIN, echo=False)
    pending = [r.name for r in study.runs() if dict(r.values)[BATCH] == "64"]
    for name in pending:  # as if never started
        for path in sorted(glob.glob(os.path.join(root, name, "*")), reverse=True):
            os.remove(path)
        os.rmdir(os.path.join(root, name))
        os.remove(os.path.join(root, "logs", f"{name}.json"))
    rows = summary.write_summary(study, root)
    return study, root, rows, pending


def _read(root):
    """TensorBoard's view of the root: run -> tag -> hparams plugin data, and the multiplexer."""
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(root)
    mux.Reload()
    return mux.PluginRunToTagToContent(metadata.PLUGIN_NAME), mux


def test_each_run_is_a_session_with_its_swept_values_and_final_metrics(study_root):
    study, root, rows, pending = study_root
    content, mux = _read(root)
    by_run = {row["run"]: row for row in rows}
    started = [r for r in study.runs() if r.name not in pending]
    assert len(started) == 4 and len(pending) == 2
    sessions = {run: tags for run, tags in content.items() if run != "."}
    assert sorted(sessions) == sorted(f"{r.name}/{hparams.DIR}" for r in started)  # none for the pending runs
    tags = ["eval_loss", "eval_top1", "examples_per_sec"]
    for run in started:
        data = metadata.parse_session_start_info_plugin_data(
            sessions[f"{run.name}/{hparams.DIR}"][metadata.SESSION_START_INFO_TAG])
        assert data.group_name == run.name
        values = {name: getattr(v, v.WhichOneof("kind")) for name, v in data.hparams.items()}
        given = dict(run.values)
        size = {"(32, 32)": "(32, 32)", "(32, 32, 3)": "(32, 32, 3)"}[given[SIZE]]  # tuples: their text
        assert values == {SEED: float(given[SEED]), BATCH: float(given[BATCH]), LR: float(given[LR]), SIZE: size}
        row = by_run[run.name]
        scalars = {tag: mux.Tensors(f"{run.name}/{hparams.DIR}", tag)
                   for tag in tags if tag in mux.GetAccumulator(f"{run.name}/{hparams.DIR}").Tags()["tensors"]}
        expected = {tag: row[tag] for tag in tags if row.get(tag) is not None}
        assert {tag: float(tensor_util.make_ndarray(events[-1].tensor_proto)) for tag, events in scalars.items()} == \
            pytest.approx(expected)
        assert all(len(events) == 1 and events[0].step == row["step"] for events in scalars.values())
    failed = by_run[started[1].name]
    assert failed["status"] == "failed" and "eval_top1" not in failed  # a session without eval metrics


def test_each_session_says_how_and_when_it_ended(study_root):
    study, root, rows, pending = study_root
    content, _ = _read(root)
    by_run = {row["run"]: row for row in rows}
    statuses = {}
    for run in study.runs():
        if run.name in pending:
            continue
        tags = content[f"{run.name}/{hparams.DIR}"]
        start = metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG])
        end = metadata.parse_session_end_info_plugin_data(tags[metadata.SESSION_END_INFO_TAG])
        statuses[by_run[run.name]["status"]] = api_pb2.Status.Name(end.status)
        record = runner.read_record(root, run.name)["attempts"]
        assert start.start_time_secs == pytest.approx(
            datetime.datetime.fromisoformat(record[0]["started"]).timestamp())
        assert end.end_time_secs == pytest.approx(start.start_time_secs + record[-1]["wall_time_s"])
        assert end.end_time_secs >= start.start_time_secs > 0
    assert statuses == {"ok": "STATUS_SUCCESS", "failed": "STATUS_FAILURE"}


def test_the_experiment_names_every_swept_binding_and_metric(study_root):
    study, root, _, _ = study_root
    content, _ = _read(root)
    experiment = metadata.parse_experiment_plugin_data(content["."][metadata.EXPERIMENT_TAG])
    keys = study.keys()
    assert [h.name for h in experiment.hparam_infos] == [SEED, BATCH, LR, SIZE]
    assert [h.display_name for h in experiment.hparam_infos] == [keys[b] for b in (SEED, BATCH, LR, SIZE)]
    domains = {h.name: [getattr(v, v.WhichOneof("kind")) for v in h.domain_discrete.values]
               for h in experiment.hparam_infos}
    assert domains[SEED] == [0, 1] and domains[BATCH] == [16, 32, 64] and domains[LR] == [1e-3, 4e-3, 1e30]
    assert sorted(domains[SIZE]) == ["(32, 32)", "(32, 32, 3)", "64"]  # mixed types: every value as its text
    assert [m.name.tag for m in experiment.metric_infos] == ["eval_loss", "eval_top1", "examples_per_sec"]
    assert all(m.name.group == "" for m in experiment.metric_infos)  # in the session's own folder
    assert all(h.differs for h in experiment.hparam_infos)  # every swept binding takes several values


def test_summarising_again_rewrites_without_piling_up_event_files(study_root):
    study, root, _, pending = study_root
    for _ in range(2):
        summary.write_summary(study, root)
    assert len(glob.glob(os.path.join(root, f"events.out.tfevents.*{hparams.SUFFIX}"))) == 1
    for run in study.runs():
        if run.name not in pending:
            assert len(os.listdir(os.path.join(root, run.name, hparams.DIR))) == 1
    assert not glob.glob(os.path.join(root, ".hparams_tmp_*"))
    content, _ = _read(root)
    assert len(content) == 1 + 4  # the experiment and one session per started run, once each


def test_domain_values_keep_one_type():
    assert hparams.domain_values(["1", "2"]) == {"1": 1, "2": 2}
    assert hparams.domain_values(["1", "2.5"]) == {"1": 1.0, "2.5": 2.5}
    assert hparams.domain_values(["True", "False"]) == {"True": True, "False": False}
    assert hparams.domain_values(["'cpu'", "'gpu'"]) == {"'cpu'": "cpu", "'gpu'": "gpu"}
    assert hparams.domain_values(["1", "'1'"]) == {"1": "1", "'1'": "'1'"}  # mixed: gin texts, still distinct
    assert hparams.domain_values(["@SyncBatchNorm", "@BatchNormalization"]) == {
        "@SyncBatchNorm": "@SyncBatchNorm", "@BatchNormalization": "@BatchNormalization"}
    assert hparams.domain_values(["None", "(1, 2)"]) == {"None": "None", "(1, 2)": "(1, 2)"}


def test_tensorboards_hparams_backend_lists_one_session_group_per_run(study_root):
    # What the dashboard shows, through the plugin's own backend (tensorboard is pinned).
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    study, root, rows, pending = study_root
    _, mux = _read(root)
    tb = type("TBContext", (), {"data_provider": data_provider.MultiplexerDataProvider(mux, root),
                                "multiplexer": mux, "logdir": root, "flags": None})()
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=[
        api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING])
    groups = list_session_groups.Handler(context.RequestContext(), backend_context.Context(tb), "", request).run()
    by_run = {row["run"]: row for row in rows}
    shown = {g.name: g for g in groups.session_groups}
    assert sorted(shown) == sorted(r.name for r in study.runs() if r.name not in pending)
    for name, group in shown.items():
        assert [s.name for s in group.sessions] == [f"{name}/{hparams.DIR}"]
        metrics = {m.name.tag: m.value for m in group.metric_values}
        assert metrics == pytest.approx({k: by_run[name][k] for k in metrics})
        assert metrics.get("eval_top1") is not None or by_run[name]["status"] == "failed"
