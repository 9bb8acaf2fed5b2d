"""Tests for `expframe.plot`: curves of fake runs into a PNG, through the API and the CLI."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from expframe import plot
from expframe.errors import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(model_dir, eval_metrics, steps=(0, 10, 20, 30)):
    model_dir.mkdir(parents=True)
    with open(model_dir / "metrics.jsonl", "w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "split": "train", "loss": 2.0 / (step + 1),
                                "examples_per_sec": 100.0}) + "\n")
            if step % 20 == 0:
                f.write(json.dumps({"step": step, "split": "eval",
                                    **{m: 0.01 * step for m in eval_metrics}}) + "\n")
        f.write("\n")  # a trailing blank line is allowed
    return str(model_dir)


@pytest.fixture
def runs(tmp_path):
    return [_write_run(tmp_path / "run_a", ["top1", "top5", "loss"]),
            _write_run(tmp_path / "run_b", ["top1", "fid"], steps=(0, 20, 40))]


def _assert_png(path):
    assert os.path.getsize(path) > 0
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()


def test_plot_runs_writes_png(runs, tmp_path):
    out = str(tmp_path / "plots" / "curves.png")  # parent dir does not exist yet
    assert plot.plot_runs(runs, out) == out
    _assert_png(out)
    with Image.open(out) as image:
        # train loss + eval top1, top5, loss, fid: 5 panels in 3 columns, 2 rows.
        width, height = image.size
        assert width > height > 0


def test_labels_name_runs_and_disambiguate_collisions(tmp_path):
    assert plot._labels(["/x/run_a", "/x/run_b/"]) == ["run_a", "run_b"]
    assert plot._labels(["/x/run", "/y/run"]) == ["/x/run", "/y/run"]


def test_series_is_step_ordered_and_per_split():
    records = [{"step": 20, "split": "eval", "top1": 0.5}, {"step": 10, "split": "eval", "top1": 0.25},
               {"step": 10, "split": "train", "loss": 1.0}]
    assert plot._series(records, "eval", "top1") == ([10, 20], [0.25, 0.5])
    assert plot._series(records, "train", "top1") == ([], [])


def test_missing_metrics_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="metrics.jsonl: not found"):
        plot.plot_runs([str(tmp_path)], str(tmp_path / "out.png"))


def test_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "split": "train", "loss": 1.0}\nnot json\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not JSON"):
        plot.read_metrics(str(tmp_path))


def test_empty_metrics_file_is_config_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no metrics"):
        plot.read_metrics(str(tmp_path))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "expframe.plot", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_success_and_errors(runs, tmp_path):
    out = str(tmp_path / "cli.png")
    ok = _cli(*runs, "--out", out)
    assert ok.returncode == 0, ok.stderr
    _assert_png(out)

    missing = _cli(runs[0], str(tmp_path / "no_such_run"), "--out", str(tmp_path / "x.png"))
    assert missing.returncode == 2
    assert "no_such_run" in missing.stderr and "metrics.jsonl" in missing.stderr
    assert not os.path.exists(tmp_path / "x.png")


def test_cli_requires_out(runs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot.main([runs[0]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and err.count("\n") == 1  # one line
