"""The study's table (summary.csv, summary.md) and plots, from runs of the fake main.py."""

import csv
import os

import pytest
from PIL import Image

from expframe.sweep import plots, runner, spec, summary
from tests.sweep.test_runner import FAKE_MAIN


@pytest.fixture
def finished_study(tmp_path):
    """Batch 16/32/64 zipped with a learning rate (32 fails), x 2 seeds, run by the fake."""
    study = spec.build_study(gin_files=["experiments/quickstart.gin"], sweeps=["run_experiment.seed=[0, 1]"],
                             zips=["Trainer.global_batch_size=[16, 32, 64]",
                                   "keras.optimizers.Adam.learning_rate=[1e-3, 1e30, 4e-3]"])
    root = str(tmp_path / "study")
    runner.run_study(study, root, main_py=FAKE_MAIN, echo=False)
    return study, root


def test_examples_per_sec_leaves_out_the_first_interval():
    rates = [(1, 1.0), (2, 10.0), (3, 30.0), (4, 20.0)]
    train = [{"step": s, "split": "train", "examples_per_sec": r} for s, r in rates]
    assert summary.examples_per_sec(train + [{"step": 4, "split": "eval", "top1": 0.5}]) == 20.0
    assert summary.examples_per_sec(train[:2]) == 5.5  # too few to drop one
    assert summary.examples_per_sec([]) is None


def test_table_has_one_row_per_run_with_values_metrics_and_status(finished_study):
    study, root = finished_study
    rows = summary.write_summary(study, root, command="python -m expframe.sweep --x")
    with open(os.path.join(root, summary.CSV), newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == [r.name for r in study.runs()]
    assert list(table[0])[:5] == ["run", "seed", "global_batch_size", "learning_rate", "status"]  # --sweep, --zip
    by_batch = {(r["global_batch_size"], r["seed"]): r for r in table}
    ok = by_batch[("64", "1")]
    assert (ok["status"], ok["exit_code"], ok["step"], ok["learning_rate"]) == ("ok", "0", "2", "0.004")
    assert float(ok["eval_top1"]) == 0.64 and float(ok["eval_loss"]) == 1.5
    assert float(ok["examples_per_sec"]) == 64 * 15.0  # median of the two logged rates (10 and 20 x batch)
    assert float(ok["wall_time_s"]) > 0 and ok["error"] == ""
    failed = by_batch[("32", "0")]
    assert (failed["status"], failed["exit_code"], failed["step"]) == ("failed", "1", "1")
    assert failed["error"] == "loss is nan at step 2; stopped." and failed["eval_top1"] == ""
    assert len(rows) == 6

    md = open(os.path.join(root, summary.MARKDOWN)).read()
    assert "python -m expframe.sweep --x" in md and "4 ok, 2 failed of 6 run(s)." in md
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 6  # header and one line per run
    assert "| seed=1,global_batch_size=64,learning_rate=0.004 | 1 | 64 | 0.004 | ok | 0 | 2 |" in md


def test_statuses_of_runs_not_run_by_this_study(tmp_path):
    study = spec.build_study(gin_files=["experiments/quickstart.gin"], sweeps=["run_experiment.seed=[0, 1, 2]"])
    root = tmp_path / "study"
    names = [r.name for r in study.runs()]
    (root / names[0]).mkdir(parents=True)
    (root / names[0] / "result.json").write_text('{"step": 5, "eval": {"top1": 0.5}, "wall_time_s": 3.0}')
    (root / names[1]).mkdir()  # e.g. a Slurm job that has not finished
    (root / names[1] / "metrics.jsonl").write_text('{"step": 2, "split": "train", "loss": 1.0}\n{"step": 4, "spl')
    rows = summary.collect(study, str(root))
    assert [r["status"] for r in rows] == ["ok", "unfinished", "pending"]
    assert (rows[0]["step"], rows[0]["eval_top1"], rows[0]["wall_time_s"]) == (5, 0.5, 3.0)
    assert rows[1]["step"] == 2  # the line cut short is left out


def _png_size(path):
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def test_plots_final_metrics_and_curves(finished_study):
    study, root = finished_study
    rows = summary.write_summary(study, root)
    written = plots.plot_study(rows, study, root)
    assert written == [os.path.join(root, plots.FINAL), os.path.join(root, plots.CURVES)]
    width, height = _png_size(written[0])
    # Seeds are repeats: one row of panels (the batch/lr zip), one column per metric
    # (eval_loss, eval_top1, examples_per_sec).
    assert width > 2 * height
    assert _png_size(written[1])[0] > 0


def test_final_metrics_plot_with_two_dimensions(tmp_path):
    study = spec.build_study(gin_files=["experiments/quickstart.gin"], sweeps=[
        "Trainer.global_batch_size=[8, 16, 32, 64]", "keras.optimizers.Adam.learning_rate=[1e-3, 2e-3]"])
    rows = [{"run": r.name, "status": "ok", "global_batch_size": dict(r.values)["Trainer.global_batch_size"],
             "learning_rate": dict(r.values)["keras.optimizers.Adam.learning_rate"], "eval_top1": 0.5 + 0.01 * i,
             "examples_per_sec": 100.0 * i} for i, r in enumerate(study.runs())]
    rows[3]["status"] = "failed"  # left out of the plot
    out = plots.plot_final(rows, study, str(tmp_path / "final.png"))
    width, height = _png_size(out)
    assert height > 0.5 * width  # two rows of panels (one per swept binding), two columns
