"""The study runner with a stand-in for main.py (tests/sweep/fake_main.py): which runs
start, which are skipped, how failures are recorded, and what each process is given."""

import json
import os
import signal
import threading

from expframe.sweep import runner, spec, summary
from tests.sweep import fake_main

FAKE_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_main.py")


def _study(*sweeps, zips=(), params=()):
    return spec.build_study(gin_files=["experiments/quickstart.gin"], gin_params=list(params),
                            sweeps=list(sweeps), zips=list(zips))


def _starts(root, name):
    path = os.path.join(root, name, "starts.txt")
    return len(open(path).read().split()) if os.path.exists(path) else 0


def test_worker_count_never_exceeds_the_cores():
    assert runner.worker_count(1, 2) == (1, 2)
    assert runner.worker_count(2, 2) == (2, 1)
    assert runner.worker_count(8, 2) == (2, 1)
    assert runner.worker_count(3, 16) == (3, 5)


def test_command_is_main_py_with_the_runs_bindings(tmp_path):
    study = _study("Trainer.global_batch_size=[16, 32]", params=["Trainer.train_steps = 2"])
    run = study.runs()[1]
    assert runner.command(study, run, str(tmp_path), "train")[1:] == [
        runner.MAIN_PY, "--gin_file=experiments/quickstart.gin", "--gin_param=Trainer.train_steps = 2",
        "--gin_param=Trainer.global_batch_size = 32", f"--model_dir={tmp_path}/global_batch_size=32",
        "--mode=train"]
    assert os.path.isfile(runner.MAIN_PY)


def test_last_error_line():
    assert runner.last_error(["step 1", "error: loss is nan at step 2", "W0000 00:00 tf says"]) == \
        "loss is nan at step 2"
    assert runner.last_error(["Traceback ...", "ValueError: boom", "E0000 12:00:00.1 x.cc:1] noise",
                              "WARNING: All log messages before absl::InitializeLog() is called are written"]) == \
        "ValueError: boom"


def test_failed_run_is_recorded_while_the_others_finish_and_rerun_skips_finished(tmp_path):
    root = str(tmp_path / "study")
    study = _study(zips=["Trainer.global_batch_size=[16, 32, 64]",
                         "keras.optimizers.Adam.learning_rate=[1e-3, 1e30, 3e-3]"])
    names = [r.name for r in study.runs()]
    outcome = runner.run_study(study, root, parallel=1, main_py=FAKE_MAIN, echo=False)
    assert [outcome[n]["exit_code"] for n in names] == [0, 1, 0]  # the third ran after the failure
    assert outcome[names[1]]["error"] == "loss is nan at step 2; stopped."
    record = runner.read_record(root, names[1])
    assert [a["exit_code"] for a in record["attempts"]] == [1]
    assert "error: loss is nan" in open(os.path.join(root, "logs", f"{names[1]}.log")).read()

    rows = {row["run"]: row for row in summary.collect(study, root)}
    assert [rows[n]["status"] for n in names] == ["ok", "failed", "ok"]
    assert rows[names[1]]["exit_code"] == 1 and rows[names[1]]["error"].startswith("loss is nan")
    assert rows[names[2]]["eval_top1"] == 0.64 and rows[names[2]]["step"] == 2

    # The same study again: finished runs are skipped, the failed one starts again.
    again = runner.run_study(study, root, parallel=1, main_py=FAKE_MAIN, echo=False)
    assert again[names[0]] is None and again[names[2]] is None
    assert again[names[1]]["exit_code"] == 1
    assert [_starts(root, n) for n in names] == [1, 2, 1]
    assert len(runner.read_record(root, names[1])["attempts"]) == 2


def _texts(study):
    """The parsed configs the fake main writes for the study's runs (what validate gives for main.py)."""
    return {r.name: fake_main.parsed_config(study.gin_params + r.gin_params) for r in study.runs()}


def test_finished_means_result_json_under_the_same_parsed_config(tmp_path):
    root = str(tmp_path / "study")
    study = _study("run_experiment.seed=[0, 1]")
    names = [r.name for r in study.runs()]
    texts = _texts(study)
    runner.run_study(study, root, texts, main_py=FAKE_MAIN, echo=False)
    # result.json under the same parsed config: finished. Without parsed_config.gin
    # (a run from before it existed) nothing says so: main.py decides.
    os.remove(os.path.join(root, names[1], "parsed_config.gin"))
    again = runner.run_study(study, root, texts, main_py=FAKE_MAIN, echo=False)
    assert again[names[0]] is None and again[names[1]]["exit_code"] == 0
    assert [_starts(root, n) for n in names] == [1, 2]


def test_stale_runs_are_not_started_and_move_stale_moves_them_aside(tmp_path, capsys):
    root = str(tmp_path / "study")
    before = _study("run_experiment.seed=[0, 1]", params=["fake.edit = 1"])
    runner.run_study(before, root, _texts(before), main_py=FAKE_MAIN, echo=False)
    # An edit (here a fixed binding; the same for an edit inside an included gin file)
    # changes every run's parsed config; a third seed is new.
    study = _study("run_experiment.seed=[0, 1, 2]", params=["fake.edit = 2"])
    texts = _texts(study)
    old, older, new = (r.name for r in study.runs())
    capsys.readouterr()
    outcome = runner.run_study(study, root, texts, main_py=FAKE_MAIN, echo=False)
    # Not started (main.py would refuse: exit 2 on every rerun), with what to do; the new one runs.
    assert outcome[old] is None and outcome[older] is None and outcome[new]["exit_code"] == 0
    assert [_starts(root, n) for n in (old, older, new)] == [1, 1, 1]
    out = capsys.readouterr().out
    assert f"[1/3] {old}: stale, not started" in out and "rerun with --move_stale" in out
    rows = {row["run"]: row for row in summary.collect(study, root, texts)}
    assert [rows[n]["status"] for n in (old, older, new)] == ["stale", "stale", "ok"]
    assert "--move_stale" in rows[old]["error"]
    assert summary.collect(study, root)[0]["status"] == "ok"  # without the expected configs: not checked

    outcome = runner.run_study(study, root, texts, main_py=FAKE_MAIN, echo=False, move_stale=True)
    assert outcome[old]["exit_code"] == 0 and outcome[older]["exit_code"] == 0 and outcome[new] is None
    (moved,) = os.listdir(os.path.join(root, runner.STALE))
    moved = os.path.join(root, runner.STALE, moved)
    for name in (old, older):  # the old run, whole, and its logs: nothing deleted
        assert open(os.path.join(moved, name, "parsed_config.gin")).read() == _texts(before)[name]
        assert os.path.isfile(os.path.join(moved, name, "result.json")) and _starts(moved, name) == 1
        assert len(runner.read_record(moved, name)["attempts"]) == 1
        assert len(runner.read_record(root, name)["attempts"]) == 1 and _starts(root, name) == 1
    assert f"moved to {os.path.join(moved, old)}, starting afresh" in capsys.readouterr().out
    rows = summary.collect(study, root, texts)
    assert [row["status"] for row in rows] == ["ok", "ok", "ok"]


def test_parallel_runs_share_the_cores(tmp_path, monkeypatch):
    monkeypatch.delenv(runner.INTRA_OP_ENV, raising=False)
    monkeypatch.setattr(runner, "available_cores", lambda: 4)
    root = str(tmp_path / "study")
    study = _study("run_experiment.seed=[0, 1, 2, 3, 4]", params=["fake.sleep_s = 0.5"])
    outcome = runner.run_study(study, root, parallel=16, main_py=FAKE_MAIN, echo=False)
    assert all(a["exit_code"] == 0 for a in outcome.values())
    for run in study.runs():
        env = json.load(open(os.path.join(root, run.name, "env.json")))
        assert env["TF_NUM_INTRAOP_THREADS"] == "1"  # 16 asked, capped at 4 processes: 4 cores / 4
    starts = sorted(float(open(os.path.join(root, r.name, "starts.txt")).read()) for r in study.runs())
    # Several ran at once (each sleeps 0.5 s), but never more than 4.
    overlapping = [sum(1 for s in starts if t <= s < t + 0.5) for t in starts]
    assert 2 <= max(overlapping) <= 4


def test_sequential_runs_keep_tensorflows_thread_default(tmp_path, monkeypatch):
    monkeypatch.delenv(runner.INTRA_OP_ENV, raising=False)
    root = str(tmp_path / "study")
    study = _study("run_experiment.seed=[0]")
    runner.run_study(study, root, parallel=1, main_py=FAKE_MAIN, echo=False)
    env = json.load(open(os.path.join(root, study.runs()[0].name, "env.json")))
    assert env["TF_NUM_INTRAOP_THREADS"] is None


def test_sigterm_is_forwarded_and_no_new_run_starts(tmp_path):
    root = str(tmp_path / "study")
    study = _study("run_experiment.seed=[0, 1]", params=["fake.sleep_s = 30"])
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        outcome = runner.run_study(study, root, main_py=FAKE_MAIN, echo=False)
    finally:
        timer.cancel()
    first, second = study.runs()
    assert outcome[first.name]["exit_code"] == -signal.SIGTERM  # the fake has no handler: it died
    assert outcome[first.name]["wall_time_s"] < 20 and outcome[first.name]["stopped_by"] == "SIGTERM"
    assert outcome[second.name] is None and _starts(root, second.name) == 0
    rows = {row["run"]: row for row in summary.collect(study, root)}
    assert {name: row["status"] for name, row in rows.items()} == {first.name: "stopped", second.name: "pending"}
    assert rows[first.name]["error"] == "stopped by SIGTERM; rerun the study to resume"


def test_a_run_killed_from_outside_is_recorded_as_crashed(tmp_path):
    root = str(tmp_path / "study")
    study = _study("fake.kill_self=[True, False]")
    outcome = runner.run_study(study, root, main_py=FAKE_MAIN, echo=False)
    killed, fine = study.runs()
    assert outcome[killed.name]["exit_code"] == -signal.SIGKILL and "stopped_by" not in outcome[killed.name]
    rows = {row["run"]: row for row in summary.collect(study, root)}
    assert (rows[killed.name]["status"], rows[killed.name]["error"]) == ("crashed", "killed by SIGKILL")
    assert rows[fine.name]["status"] == "ok"
