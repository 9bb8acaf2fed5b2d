"""Provenance (issue 22): what every run records about the code, versions, machine and
load, and how metrics.jsonl's provenance records sit beside the metrics: each reader
(plots, study tables, resume) skips them, only the chief writes them, a resume adds
one. Through main.py: tests/test_reproduce.py (result.json and metrics.jsonl of real runs)."""

import json
import os
import subprocess

import pytest

from expframe import plot, provenance
from expframe.reproduce import running
from expframe.run_files import RunFiles
from expframe.sweep import spec, summary
from tests import main_runner as mr


def _git(*args):
    return subprocess.run(["git", *args], cwd=mr.ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_record_names_the_commit_versions_machine_and_load():
    record = provenance.record()
    assert record["commit"] == _git("rev-parse", "HEAD")
    assert record["dirty"] == bool(_git("status", "--porcelain", "--", ".", ":(exclude)docs"))
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe import __version__  # pylint: disable=import-outside-toplevel
    assert (record["tensorflow"], record["keras"], record["expframe"]) == (tf.__version__, keras.__version__,
                                                                         __version__)
    machine = record["machine"]
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpuinfo = f.read()
    assert machine["cpu"] in cpuinfo and machine["cores"] == len(os.sched_getaffinity(0))
    assert machine["avx512"] == (" avx512f" in cpuinfo)
    assert machine["bf16"] == (" avx512_bf16" in cpuinfo or " amx_bf16" in cpuinfo)
    assert len(record["load_average"]) == 3 and all(x >= 0 for x in record["load_average"])
    end = provenance.finished(record)
    assert end["commit"] == record["commit"] and len(end["load_average_end"]) == 3 and end["finished"]


def test_a_change_under_docs_does_not_make_the_checkout_dirty_a_code_change_does(tmp_path):
    """`python -m expframe.reproduce` rewrites docs/results.md while it runs: a later result
    from the same code must not read as made from uncommitted changes."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text("old\n")
    (tmp_path / "main.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    assert provenance.commit(str(tmp_path))[1] is False
    (tmp_path / "docs" / "results.md").write_text("new page\n")
    assert provenance.commit(str(tmp_path))[1] is False
    (tmp_path / "main.py").write_text("x = 2\n")
    assert provenance.commit(str(tmp_path))[1] is True


def test_an_untracked_module_makes_the_checkout_dirty_an_untracked_doc_or_ignored_file_does_not(tmp_path):
    """A run of a module never committed (a new task beside the shipped ones) is not a
    run of the commit; a new page under docs/ or a file git ignores (runs/) changes nothing."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text("page\n")
    (tmp_path / "main.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("/runs/\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    (tmp_path / "docs" / "images").mkdir()
    (tmp_path / "docs" / "images" / "new.png").write_bytes(b"png")
    (tmp_path / "docs" / "new_page.md").write_text("new\n")
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    (tmp_path / "runs" / "quickstart" / "metrics.jsonl").write_text("{}\n")
    assert provenance.commit(str(tmp_path))[1] is False
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "wave_task.py").write_text("class WaveTask: pass\n")
    assert provenance.commit(str(tmp_path))[1] is True


def test_a_directory_that_is_not_the_top_of_a_checkout_is_not_a_git_checkout(tmp_path):
    assert provenance.commit(str(tmp_path)) == (provenance.NOT_A_CHECKOUT, False)
    inside = os.path.join(mr.ROOT, "expframe")  # in the checkout, but not its top: an installed copy would be so
    assert provenance.commit(inside) == (provenance.NOT_A_CHECKOUT, False)


def _run_dir(tmp_path):
    """A model_dir as a resumed run leaves it: provenance at 0, train and eval, provenance at 4."""
    files = RunFiles(str(tmp_path / "run"))
    files.start("config", 0)
    files.log_provenance(0, {"commit": "abc", "machine": {"cpu": "x", "cores": 2}, "load_average": [0.5, 0.4, 0.3]})
    for step in (2, 4):
        files.log_metrics(step, "train", {"loss": 1.0 / step, "examples_per_sec": 10.0 * step})
    files.log_metrics(4, "eval", {"top1": 0.5, "loss": 1.2})
    files.log_provenance(4, {"commit": "def", "machine": {"cpu": "x", "cores": 2}, "load_average": [3.0, 2.0, 1.0]})
    files.log_metrics(6, "train", {"loss": 0.1, "examples_per_sec": 70.0})
    files.log_metrics(6, "eval", {"top1": 0.75, "loss": 0.9})
    files.close()
    return tmp_path / "run"


def test_provenance_records_are_metrics_lines_that_every_reader_skips(tmp_path):
    model_dir = _run_dir(tmp_path)
    lines = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 0, "split": "provenance", "commit": "abc", "machine": {"cpu": "x", "cores": 2},
                        "load_average": [0.5, 0.4, 0.3]}
    assert [(r["step"], r["split"]) for r in lines if r["split"] == "provenance"] == [(0, "provenance"),
                                                                                   (4, "provenance")]
    # expframe.plot: the panels are train loss and the eval metrics, nothing of provenance.
    records = plot.read_metrics(str(model_dir))
    assert len(records) == len(lines)
    out = plot.plot_runs([str(model_dir)], str(tmp_path / "curves.png"))
    assert os.path.getsize(out) > 0
    # The study table: the last eval, the last step, the train rates.
    study = spec.Study("s", ["x.gin"], [], [spec.Axis(("run_experiment.seed",), (("0",),), "test")])
    os.rename(model_dir, tmp_path / "seed=0")
    row = summary.collect(study, str(tmp_path))[0]
    assert (row["step"], row["eval_top1"], row["examples_per_sec"]) == (6, 0.75, 55.0)
    assert not any(k.startswith("eval_") and k not in ("eval_top1", "eval_loss") for k in row)
    # tests' own reader leaves them out unless asked.
    assert [r["split"] for r in mr.metrics(tmp_path / "seed=0")] == ["train", "train", "eval", "train", "eval"]


def test_resume_keeps_the_provenance_of_earlier_starts_up_to_its_step(tmp_path):
    model_dir = _run_dir(tmp_path)
    RunFiles(str(model_dir)).start("config", resumed_step=4)
    kept = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in kept] == [(0, "provenance"), (2, "train"), (4, "train"), (4, "eval"),
                                                       (4, "provenance")]


def test_only_the_chief_writes_provenance(tmp_path):
    files = RunFiles(str(tmp_path / "run"), is_chief=False, worker_index=1)
    files.start("config", 0)
    private = files.model_dir
    files.log_provenance(0, {"commit": "abc"})
    assert not os.path.exists(os.path.join(private, "metrics.jsonl"))
    files.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, shown", [
    (["python", "x.py"], "python x.py"),
    ([os.path.join(mr.ROOT, "main.py"), "--model_dir=" + os.path.join(mr.ROOT, "runs", "a")],
     "main.py --model_dir=runs/a"),
    (["main.py", "--gin_param=Trainer.train_steps = 2"], "main.py '--gin_param=Trainer.train_steps = 2'"),
])
def test_commands_are_shown_as_typed_from_the_repository(argv, shown):
    assert running.shown(argv) == shown
