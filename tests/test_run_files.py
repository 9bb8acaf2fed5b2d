"""metrics.jsonl on resume (issue 9, item 11): records past the resumed step go, a torn
last line (a crash while appending it) is dropped with a line saying so, any other
unreadable line is an error that leaves the file as it was."""

import json

import pytest

from expframe.errors import RunError
from expframe.run_files import RunFiles

RECORDS = [{"step": s, "split": "train", "loss": 1.0 / s} for s in (1, 2, 3, 4)]


def _write(model_dir, text):
    model_dir.mkdir(exist_ok=True)
    (model_dir / "metrics.jsonl").write_text(text, encoding="utf-8")


def _steps(model_dir):
    lines = (model_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_resume_keeps_the_records_up_to_its_step(tmp_path):
    _write(tmp_path, "".join(json.dumps(r) + "\n" for r in RECORDS))
    RunFiles(str(tmp_path)).start("config", resumed_step=2)
    assert _steps(tmp_path) == [1, 2]


def test_a_torn_last_line_is_dropped_and_logged(tmp_path, capsys):
    whole = "".join(json.dumps(r) + "\n" for r in RECORDS[:3])
    _write(tmp_path, whole + json.dumps(RECORDS[3])[:17])  # killed while appending step 4
    RunFiles(str(tmp_path)).start("config", resumed_step=3)
    assert _steps(tmp_path) == [1, 2, 3]
    assert "dropped the torn last line 4 of" in capsys.readouterr().out
    files = RunFiles(str(tmp_path))
    files.log_metrics(5, "train", {"loss": 0.5})
    files.close()
    assert _steps(tmp_path) == [1, 2, 3, 5]


def test_a_bad_line_before_the_last_is_an_error_and_nothing_is_written(tmp_path):
    text = json.dumps(RECORDS[0]) + "\n" + "{oops\n" + json.dumps(RECORDS[1]) + "\n"
    _write(tmp_path, text)
    with pytest.raises(RunError, match=r"metrics.jsonl line 2 is not a JSON metrics record \('\{oops'\)"):
        RunFiles(str(tmp_path)).start("config", resumed_step=2)
    assert (tmp_path / "metrics.jsonl").read_text(encoding="utf-8") == text
    assert not (tmp_path / "config.gin").exists()
