"""`python -m expframe.sweep`'s exit status and stale runs, with the fake main.py
(tests/sweep/fake_main.py) in place of main.py and of `spec.validate`'s parsed configs, no plots:
exit 0 only when every row is `ok`; an edited configuration makes finished runs
`stale` (in the summary too), and --move_stale moves them aside and runs them again."""

import csv
import functools
import os
import signal
import threading

import pytest

from expframe.sweep import __main__ as cli
from expframe.sweep import runner, summary
from tests import main_runner as mr
from tests.sweep import fake_main
from tests.sweep.test_runner import FAKE_MAIN

BASE = ["--gin_file=experiments/quickstart.gin"]


def _texts(study):
    return {r.name: fake_main.parsed_config(study.gin_params + r.gin_params) for r in study.runs()}


@pytest.fixture(autouse=True)
def fake_runs(monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    monkeypatch.setattr(cli.spec, "validate", _texts)
    monkeypatch.setattr(cli.runner, "run_study", functools.partial(runner.run_study, main_py=FAKE_MAIN))
    monkeypatch.setattr(cli.plots, "plot_study", lambda rows, study, root: [])  # tested in test_summary.py


def _statuses(root):
    with open(os.path.join(root, summary.CSV), newline="") as f:
        return {row["run"]: row["status"] for row in csv.DictReader(f)}


def test_exit_1_when_runs_are_left_stopped_or_pending(tmp_path, capsys):
    root = str(tmp_path / "study")
    argv = BASE + ["--sweep=run_experiment.seed=[0, 1]", "--gin_param=fake.sleep_s = 30", f"--study_dir={root}"]
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = cli.main(argv)
    finally:
        timer.cancel()
    assert code == 1
    assert _statuses(root) == {"seed=0": "stopped", "seed=1": "pending"}
    err = capsys.readouterr().err
    assert err == ("error: 2 of 2 run(s) not ok: 1 stopped (seed=0): rerun the same command to resume; "
                   "1 pending (seed=1): rerun the same command to run.\n")


def test_exit_1_for_a_run_that_exits_0_without_a_result_and_0_when_all_are_ok(tmp_path, capsys):
    root = str(tmp_path / "study")
    assert cli.main(BASE + ["--sweep=fake.no_result=[True, False]", f"--study_dir={root}"]) == 1
    assert _statuses(root) == {"no_result=True": "stopped", "no_result=False": "ok"}
    assert "1 of 2 run(s) not ok: 1 stopped (no_result=True)" in capsys.readouterr().err
    root = str(tmp_path / "fine")
    assert cli.main(BASE + ["--sweep=run_experiment.seed=[0]", f"--study_dir={root}"]) == 0
    assert capsys.readouterr().err == ""


def test_edited_config_makes_runs_stale_until_move_stale_runs_them_again(tmp_path, capsys):
    root = str(tmp_path / "study")
    sweep = ["--sweep=run_experiment.seed=[0, 1]", f"--study_dir={root}"]
    assert cli.main(BASE + sweep + ["--gin_param=fake.edit = 1"]) == 0
    edited = BASE + sweep + ["--gin_param=fake.edit = 2"]  # as an edit inside an included gin file would
    capsys.readouterr()
    # The summary reports the old numbers as stale, not ok.
    assert cli.main(edited + ["--emit=summary"]) == 1
    assert _statuses(root) == {"seed=0": "stale", "seed=1": "stale"}
    assert "2 stale (seed=0, seed=1): rerun with --move_stale" in capsys.readouterr().err
    # Running: not started (main.py would refuse them with exit 2 every time), said so.
    assert cli.main(edited) == 1
    out, err = capsys.readouterr()
    assert "seed=0: stale, not started" in out and "2 stale (seed=0, seed=1)" in err
    assert [len(runner.read_record(root, n)["attempts"]) for n in ("seed=0", "seed=1")] == [1, 1]
    # --move_stale: the old runs go to stale/<time>/ and run again under the new config.
    assert cli.main(edited + ["--move_stale"]) == 0
    assert _statuses(root) == {"seed=0": "ok", "seed=1": "ok"}
    (moved,) = os.listdir(os.path.join(root, runner.STALE))
    assert sorted(os.listdir(os.path.join(root, runner.STALE, moved))) == ["logs", "seed=0", "seed=1"]
    assert cli.main(edited) == 0  # and now they are finished
