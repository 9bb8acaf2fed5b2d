"""`python -m expframe.reproduce` (issue 22): the registry the slow tests share, the
results page, and `--set=quick` end to end: every result at a tiny size through the
sweep runner and the benchmark scripts, a valid page in a temporary directory (the
committed docs/results.md untouched), provenance in every run, and a rerun that
skips what is recorded."""

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from unittest import mock

import pytest
from PIL import Image

from expframe.reproduce import __main__ as cli
from expframe.reproduce import benchmark_rows, page, quiet, registry, running, spread
from tests import main_runner as mr

HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=mr.ROOT, capture_output=True, text=True).stdout.strip()


def test_thresholds_absolute_and_relative_to_initialisation():
    top1 = registry.Threshold("top1", ">=", 0.9)
    assert top1.holds({"top1": 0.9}) and not top1.holds({"top1": 0.89}) and not top1.holds({})
    assert not top1.holds({"top1": float("nan")}) and top1.text() == "top1 >= 0.9"
    fid = registry.Threshold("fid", "<=", 0.25, of_initial=True)
    assert fid.holds({"fid": 25.0}, {"fid": 100.0}) and not fid.holds({"fid": 25.1}, {"fid": 100.0})
    assert fid.text({"fid": 100.0}) == "fid <= 0.25 x its value at initialisation = 25"
    with pytest.raises(ValueError, match="needs the fid at initialisation"):
        fid.holds({"fid": 1.0})
    assert registry.get("sngan_shapes").passed({"fid": 20.0, "sample_accuracy": 0.8}, {"fid": 100.0})
    assert not registry.get("sngan_shapes").passed({"fid": 20.0, "sample_accuracy": 0.79}, {"fid": 100.0})
    # A margin over a baseline: D4PG from pixels must beat the random policy by 200.
    pixels, floor = registry.get("d4pg_control_pixels"), {"random_policy_return": 109.0, "episode_return": 400.0}
    assert pixels.passed({"episode_return": 309.0}, floor) and not pixels.passed({"episode_return": 308.9}, floor)
    assert pixels.thresholds[0].text(floor) == "episode_return >= random_policy_return + 200 = 309"
    with pytest.raises(ValueError, match="needs the random_policy_return at initialisation"):
        pixels.passed({"episode_return": 500.0}, {"episode_return": 400.0})


def test_every_slow_learning_test_reads_its_experiment_and_threshold_from_the_registry():
    for result in registry.LEARNING:
        with open(os.path.join(mr.ROOT, result.test), encoding="utf-8") as f:
            text = f.read()
        assert f'registry.get("{result.name}")' in text, result.test
        assert ".passed(" in text, result.test  # the threshold comes from the entry too
    names = [r.name for r in registry.ALL]
    assert len(names) == len(set(names))
    assert registry.results("all") == registry.LEARNING + registry.STUDIES + registry.BENCHMARKS
    with pytest.raises(KeyError, match="known: quickstart"):
        registry.get("nope")


def test_only_names_results_of_the_set_or_exits_2(capsys):
    assert cli.main(["--set=learning", "--only=collectives"]) == 2
    err = capsys.readouterr().err
    assert "--only=collectives: collectives not in --set=learning (it holds" in err and "quickstart" in err


def test_a_run_made_under_another_configuration_is_set_aside_not_resumed(tmp_path, capsys):
    """An edited gin file between two reproduce runs: main.py would refuse to resume the
    old model_dir (exit 2); reproduce moves it, with its logs, and runs it again."""
    from expframe.sweep import runner, spec  # pylint: disable=import-outside-toplevel
    study = spec.Study("s", ["x.gin"], [], [spec.Axis(("run_experiment.seed",), (("0",), ("1",)), "test")])
    root = tmp_path / "s"
    for name, text in (("seed=0", "old\n"), ("seed=1", "same\n")):
        (root / name).mkdir(parents=True)
        (root / name / "parsed_config.gin").write_text(text)
    (root / runner.LOGS).mkdir()
    (root / runner.LOGS / "seed=0.json").write_text("{}")
    moved = running.set_aside_stale(study, str(root), {"seed=0": "new\n", "seed=1": "same\n"})
    assert len(moved) == 1 and moved[0].startswith(str(root / running.STALE / "seed=0."))
    assert not (root / "seed=0").exists() and (root / "seed=1" / "parsed_config.gin").read_text() == "same\n"
    assert open(os.path.join(moved[0], "model_dir", "parsed_config.gin")).read() == "old\n"
    assert os.path.exists(os.path.join(moved[0], runner.LOGS, "seed=0.json"))
    assert "seed=0: made under another configuration; moved to" in capsys.readouterr().out


# -- the page -------------------------------------------------------------------------------------

def _provenance(name, quick, wall=61.0):
    return {"name": name, "quick": quick, "reproduce": f"python -m expframe.reproduce --set=x --only={name}",
            "started": "2026-12-01T10:00:00+00:00", "finished": "2026-12-01T10:01:01+00:00", "commit": HEAD,
            "dirty": False, "expframe": "0.1.0", "tensorflow": "2.21.0", "keras": "3.15.1",
            "machine": {"cpu": "Test CPU", "cores": 2, "avx512": False, "bf16": True, "platform": "Linux",
                        "python": "3.11.7"},
            "load_average_start": [0.5, 0.4, 0.3], "load_average_end": [1.5, 0.9, 0.5], "other_cores": 0.03,
            "wall_s": wall, "complete": True}


def _study_run(batch, lr, seed, fid, accuracy):
    return {"run": f"global_batch_size={batch},LR={lr},seed={seed}", "status": "ok", "step": 1500,
            "values": {"global_batch_size": str(batch), "LR": str(lr), "seed": str(seed)},
            "final": {"fid": fid, "sample_accuracy": accuracy}, "model_dir": None}


def _write_records(work):
    quickstart = dict(_provenance("quickstart", False), kind="experiment", passed=True,
                      commands=["python main.py --gin_file=experiments/quickstart.gin"],
                      runs=[{"run": "seed=0", "status": "ok", "step": 1200, "final": {"top1": 0.9375, "loss": 0.2},
                             "model_dir": None, "thresholds": [{"text": "top1 >= 0.9", "holds": True}]}])
    study = dict(_provenance("sngan_batch", False), kind="study", commands=["python main.py ..."],
                 runs=[_study_run(16, 0.001, 0, 9.0, 0.3), _study_run(16, 0.001, 1, 11.0, 0.2),
                       _study_run(64, 0.001, 0, 5.0, 0.5), _study_run(64, 0.001, 1, 7.0, 0.4),
                       _study_run(16, 0.0005, 0, 12.0, 0.1)])
    bench = dict(_provenance("collectives", False), kind="benchmark", commands=["python benchmarks/collectives.py"],
                 rows=[benchmark_rows.row("all-reduce / copy", 1.7, spread.at_most(3.0), spread.of([1.6, 1.7, 1.8]))])
    for rec in (quickstart, study, bench):
        os.makedirs(os.path.join(work, running.RECORDS), exist_ok=True)
        with open(running.record_path(work, rec["name"]), "w", encoding="utf-8") as f:
            json.dump(rec, f)


def _assert_png(path):
    with Image.open(path) as image:
        image.verify()


def _sections(text):
    """result name -> its section's text."""
    parts = re.split(r'<a id="([a-z0-9_]+)"></a>', text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def check_page(path, results, expect_commit=HEAD):
    """Every result has a section; a recorded one states its numbers, commands, commit,
    machine, load at start and end, wall time, dates and threshold; its images exist."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    sections = _sections(text)
    assert list(sections) == [r.name for r in results]
    recorded = []
    for result in results:
        body = sections[result.name]
        if "Pending: not run yet." in body:
            assert f"--only={result.name}" in body
            continue
        recorded.append(result.name)
        assert f"- Commit: `{expect_commit[:12]}`" in body, result.name
        assert re.search(r"- Machine: .+, \d+ cores, AVX-512 (yes|no), bf16 (yes|no); .*TensorFlow \S+, Keras \S+",
                         body), result.name
        assert re.search(r"- Load average \(1 / 5 / 15 min\): [\d.]+ / [\d.]+ / [\d.]+ at the start, "
                         r"[\d.]+ / [\d.]+ / [\d.]+ at the end", body), result.name
        dates = re.search(r"- Wall time: [\d.]+ min \([\d,]+ s\), (\S+) to (\S+)", body)
        assert dates, result.name
        for date in dates.groups():
            datetime.datetime.fromisoformat(date)
        assert "python main.py " in body or "python benchmarks/" in body, result.name
        if result.kind == "experiment":
            assert "Result: **" in body and "| threshold (slow test) | passed |" in body
            for threshold in result.thresholds:
                assert threshold.metric in body and threshold.op in body
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", body):
            _assert_png(os.path.join(os.path.dirname(path), image))
    return text, sections, recorded


def test_page_states_each_result_with_its_provenance_and_the_pending_ones(tmp_path):
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    _write_records(work)
    commands = {r.name: f"python -m expframe.reproduce --set={registry.set_of(r)} --only={r.name}"
                for r in registry.ALL}
    path = page.write(work, out, False, registry.ALL, commands, ["| set | command |"])
    text, sections, recorded = check_page(path, registry.ALL)
    assert recorded == ["quickstart", "sngan_batch", "collectives"]
    assert "| [quickstart](#quickstart) | top1 0.9375, loss 0.2 | top1 >= 0.9 | yes | 2026-12-01 | " \
           "0.50 / 1.50 (yes) | 1.0 min |" in text
    assert "| [vit_shapes_mesh](#vit_shapes_mesh) | pending: `python -m expframe.reproduce --set=learning " \
           "--only=vit_shapes_mesh` |" in text
    assert "Quoted in [README.md](../README.md#expframe)." in sections["quickstart"]
    assert "other processes used 0.03 cores on average" in sections["quickstart"]
    study = sections["sngan_batch"]
    # Means over seeds per arm; the batch-64 point at the base rate is in both arms' lines.
    assert "| fixed rate | 16 | 2 | 10 | 0.25 |" in study and "| fixed rate | 64 | 2 | 6 | 0.45 |" in study
    assert "| rate x sqrt(batch / 64) | 16 | 1 | 12 | 0.1 |" in study
    assert "| rate x sqrt(batch / 64) | 64 | 2 | 6 | 0.45 |" in study
    assert "- fixed rate, fid: 10 at global_batch_size 16, 6 at 64 (change -4; the largest spread between seeds " \
           "at one point is 2): the largest global_batch_size is better; best at 64" in study
    assert "- fixed rate, sample_accuracy: 0.25 at global_batch_size 16, 0.45 at 64 (change +0.2; the largest " \
           "spread between seeds at one point is 0.1): the largest global_batch_size is better; best at 64" in study
    _assert_png(os.path.join(out, "results", "sngan_batch.png"))
    assert "| all-reduce / copy | 1.7 | 1.6 / 1.8 | 1.6 to 1.8 (±5.9%) | 3 | goal <= 3 | meets the goal |" \
        in sections["collectives"]
    # Quick records are not mixed into a full page, nor full ones into a quick page.
    quick_path = page.write(work, str(tmp_path / "quick"), True, registry.ALL, commands, [])
    assert "Pending: not run yet." in _sections(open(quick_path, encoding="utf-8").read())["quickstart"]


def test_pixel_results_show_the_published_numbers_and_curves_against_control_steps(tmp_path):
    """The 100k-control-step result sits above DrQ's and CURL's numbers (mean and range over
    its seeds); the actor study draws each run's eval return against control steps, from
    the run's own env_steps x 8, and still shows a run that stopped part way."""
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    check = [{"text": "episode_return >= random_policy_return + 200 = 320", "holds": True}]
    budget = dict(_provenance("d4pg_control_pixels_100k", False), kind="experiment", passed=True,
                  commands=["python main.py --gin_file=experiments/d4pg_control_pixels_100k.gin"],
                  runs=[{"run": f"seed={s}", "status": "ok", "step": 11500, "final": {"episode_return": r},
                         "model_dir": None, "thresholds": check} for s, r in ((0, 330.0), (1, 410.0))])
    runs = []
    for actors, replicas, seed, stop in ((0, 1, 0, 3), (1, 2, 1, 2)):  # the second stopped after 2 evals
        model_dir = tmp_path / f"num_actors={actors},seed={seed}"
        model_dir.mkdir()
        lines = [{"step": s, "split": "train", "env_steps": 1000 + 2 * s} for s in (0, 100, 200, 300)]
        lines += [{"step": s, "split": "eval", "episode_return": s + seed} for s in (100, 200, 300)[:stop]]
        (model_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        runs.append({"run": model_dir.name, "status": "ok" if stop == 3 else "stopped", "step": 100 * stop,
                     "values": {"num_actors": str(actors), "num_replicas": str(replicas), "seed": str(seed)},
                     "final": {"episode_return": 100.0 * stop + seed} if stop == 3 else {},
                     "model_dir": str(model_dir)})
    study = dict(_provenance("d4pg_pixels_actors", False), kind="study", commands=["python main.py ..."], runs=runs)
    os.makedirs(os.path.join(work, running.RECORDS))
    for rec in (budget, study):
        with open(running.record_path(work, rec["name"]), "w", encoding="utf-8") as f:
            json.dump(rec, f)
    results = [registry.get("d4pg_control_pixels_100k"), registry.get("d4pg_pixels_actors")]
    path = page.write(work, out, False, results, {r.name: "x" for r in results}, [])
    _, sections, recorded = check_page(path, results)
    assert recorded == ["d4pg_control_pixels_100k", "d4pg_pixels_actors"]
    body = sections["d4pg_control_pixels_100k"]
    assert "| this run (expframe D4PG) | 370 (range 330 to 410, 2 seeds) | above |" in body
    assert "| DrQ [K=2,M=2] | 759 ± 92 | Kostrikov et al., arXiv 2004.13649 (ICLR 2021), Table 1 |" in body
    assert "| CURL | 582 ± 146 |" in body
    assert "against control steps (agent steps x action repeat 8), one line per run" in sections["d4pg_pixels_actors"]
    _assert_png(os.path.join(out, "results", "d4pg_pixels_actors_curves.png"))
    # The points drawn: eval steps 100, 200, 300 at env steps 1200, 1400, 1600, x 8.
    drawn = []
    with mock.patch("matplotlib.axes.Axes.plot", side_effect=lambda x, y, *a, **k: drawn.append((list(x), y))):
        page._study_curves(registry.get("d4pg_pixels_actors"), study, str(tmp_path / "c.png"))  # pylint: disable=protected-access
    assert drawn == [([9600.0, 11200.0, 12800.0], [100.0, 200.0, 300.0]), ([9600.0, 11200.0], [101.0, 201.0])]
    assert page._study_curves(registry.get("d4pg_pixels_actors"), dict(study, runs=[]), "x.png") is None  # pylint: disable=protected-access
    # One colour per configuration, one line style per seed: 1 actor on 1 and on 2 replicas
    # (one arm, two x values) are told apart; a second seed of one of them shares its colour.
    done = dict(runs[0], status="ok")
    configs = [dict(done, values={"num_actors": "1", "num_replicas": r, "seed": s}) for r, s in
               (("1", "0"), ("2", "0"), ("1", "1"))]
    styles = []
    with mock.patch("matplotlib.axes.Axes.plot", side_effect=lambda x, y, *a, **k: styles.append((a[0], k["color"]))):
        page._study_curves(registry.get("d4pg_pixels_actors"), dict(study, runs=configs), str(tmp_path / "d.png"))  # pylint: disable=protected-access
    assert styles == [("-", "C0"), ("-", "C1"), ("--", "C0")]
    # A study that varies an experiment draws that experiment's kept runs beside its own, in
    # grey, one line style per seed, from the kept folder of the page being written.
    batch = registry.get("d4pg_pixels_100k_batch")
    assert batch.beside == "d4pg_control_pixels_100k" and batch.beside in [r.name for r in registry.ALL]
    for seed in (0, 1):
        run_dir = tmp_path / "docs" / "results" / "runs" / batch.beside / f"seed={seed}"
        run_dir.mkdir(parents=True)
        shutil.copyfile(tmp_path / "num_actors=0,seed=0" / "metrics.jsonl", run_dir / "metrics.jsonl")
        (run_dir / "result.json").write_text(json.dumps({"step": 300, "eval": {"episode_return": 300.0}}))
    styles.clear()
    with mock.patch("matplotlib.axes.Axes.plot", side_effect=lambda x, y, *a, **k: styles.append((a[0], k["color"]))):
        page._study_curves(batch, dict(study, runs=configs[:1]), str(tmp_path / "e.png"),
                          page._beside_runs(batch, out))  # pylint: disable=protected-access
    assert styles == [("-", "C0"), ("-", "0.55"), ("--", "0.55")]


def test_results_of_earlier_sittings_without_records_here_keep_their_rows_and_sections(tmp_path):
    """Records stay in the (uncommitted) work directory: on a fresh checkout a new result
    used to rewrite the page without every result measured elsewhere. Those keep their row
    and section, word for word, until they are run again here."""
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    _write_records(work)
    commands = {r.name: f"python -m expframe.reproduce --set={registry.set_of(r)} --only={r.name}"
                for r in registry.ALL}
    before = open(page.write(work, out, False, registry.ALL, commands, []), encoding="utf-8").read()
    fresh = str(tmp_path / "fresh_checkout")
    os.makedirs(os.path.join(fresh, "records"))
    shutil.copy(os.path.join(work, "records", "collectives.json"), os.path.join(fresh, "records"))
    with open(running.record_path(fresh, "collectives"), encoding="utf-8") as f:
        rec = json.load(f)
    rec["rows"][0]["value"] = 1.9   # measured again here
    with open(running.record_path(fresh, "collectives"), "w", encoding="utf-8") as f:
        json.dump(rec, f)
    after = open(page.write(fresh, out, False, registry.ALL, commands, []), encoding="utf-8").read()
    old, new = _sections(before), _sections(after)
    for name in ("quickstart", "sngan_batch"):
        assert new[name] == old[name], name
        row = next(line for line in before.splitlines() if line.startswith(f"| [{name}](#{name}) |"))
        assert row in after.splitlines() and "pending" not in row
    assert "| all-reduce / copy | 1.9 | 1.6 / 1.8 |" in new["collectives"]
    assert "| all-reduce / copy | 1.7 |" in old["collectives"]
    assert new["vit_shapes_mesh"] == old["vit_shapes_mesh"] and "Pending: not run yet." in new["vit_shapes_mesh"]
    assert after.count("<a id=") == before.count("<a id=") == len(registry.ALL)


def test_a_study_stopped_and_resumed_is_recorded_over_its_sittings(tmp_path, monkeypatch):
    """A study longer than one sitting: each stopped invocation keeps its sitting (times,
    load, machine), the page shows the result pending with them, and the record that
    completes it holds every sitting, its wall time their sum, quiet only if each was."""
    work, out = str(tmp_path / "work"), str(tmp_path / "docs")
    result = registry.SNGAN_BATCH
    monkeypatch.setattr(running, "signature", lambda result, quick: "sig-a")
    monkeypatch.setattr(running.provenance, "cores", lambda: 2)  # the machine each sitting records
    load = [0.5, 0.4, 0.3]
    monkeypatch.setattr(running.provenance, "load_average", lambda: list(load))

    def stopped(*args):
        time.sleep(0.2)
        load[0] = 1.2
        raise running.Stopped("sngan_batch stopped; rerun the same command to resume it")
    monkeypatch.setattr(running, "_run_parts", stopped)
    with pytest.raises(running.Stopped):
        running.run(result, work, False, "python -m expframe.reproduce --set=studies")
    first = running.read_sittings(work, result.name)
    assert [(s["ended"], s["load_average_start"][0], s["load_average_end"][0]) for s in first] == [
        ("stopped", 0.5, 1.2)] and first[0]["wall_s"] >= 0.2
    assert running.read_sittings(work, result.name, "sig-b") == []  # another configuration starts over
    commands = {r.name: f"python -m expframe.reproduce --set={registry.set_of(r)} --only={r.name}"
                for r in registry.ALL}
    text = open(page.write(work, out, False, registry.ALL, commands, []), encoding="utf-8").read()
    assert "| [sngan_batch](#sngan_batch) | pending (started: 1 sitting so far, 0.0 min, the last ended " in text
    assert "Pending: started: 1 sitting so far, 0.0 min" in _sections(text)["sngan_batch"]

    def completes(*args):
        time.sleep(0.3)
        load[0] = 1.5
        return dict(_provenance("sngan_batch", False), kind="study", commands=["python main.py ..."],
                    runs=[_study_run(16, 0.001, 0, 9.0, 0.3)], complete=True)
    monkeypatch.setattr(running, "_run_parts", completes)
    load[0] = 2.5
    rec = running.run(result, work, False, "python -m expframe.reproduce --set=studies")
    assert [s["ended"] for s in rec["sittings"]] == ["stopped", "complete"]
    assert rec["wall_s"] == round(sum(s["wall_s"] for s in rec["sittings"]), 1) and rec["sittings"][1]["wall_s"] >= 0.3
    assert (rec["started"], rec["load_average_start"][0], rec["load_average_end"][0]) == (first[0]["started"], 0.5,
                                                                                         1.5)
    assert not os.path.exists(running.sittings_path(work, result.name))
    section = _sections(open(page.write(work, out, False, registry.ALL, commands, []), encoding="utf-8").read())[
        "sngan_batch"]
    assert ", in 2 sittings (" in section
    assert re.search(r"  1\. \S+ to \S+, 0\.0 min, stopped; load average 0\.50 at the start, 1\.20 at the end", section)
    assert re.search(r"  2\. \S+ to \S+, 0\.0 min, complete; load average 2\.50 at the start, 1\.50 at the end",
                     section)
    ok, busy = quiet.quiet(rec)  # the second began at 2.5 on 2 cores (the first at 0.5 is quiet)
    assert ok is False and [b for b in busy if b.startswith("load")] == ["load 2.50 at the start on 2 cores"]


def test_an_experiments_seeds_run_side_by_side_when_it_says_so(tmp_path, monkeypatch):
    """The 100k-control-step file runs its 2 seeds at once (`Experiment.parallel`); an
    experiment that says nothing runs its seeds one at a time."""
    assert registry.get("d4pg_control_pixels_100k").parallel == 2 and registry.get("quickstart").parallel == 1
    asked = []

    def sweep(study, root, parallel, kept_dir=None):
        asked.append((len(study.runs()), parallel))
        return [{"run": r.name, "status": "stopped"} for r in study.runs()], {}
    monkeypatch.setattr(running, "run_sweep", sweep)
    for name in ("d4pg_control_pixels_100k", "quickstart"):
        with pytest.raises(running.Stopped):
            running.run(registry.get(name), str(tmp_path / name), False, "python -m expframe.reproduce",
                        parallel=registry.get(name).parallel)
    assert asked == [(2, 2), (1, 1)]


def _judged(cores=2, start=(0.5,), end=0.5, other=0.03):
    rec = dict(_provenance("quickstart", False), load_average_end=[end, 0.4, 0.3], other_cores=other)
    rec["machine"] = dict(rec["machine"], cores=cores)
    sittings = [dict(load_average_start=[s, 0.4, 0.3], machine=rec["machine"]) for s in start]
    if len(sittings) > 1:
        rec["sittings"] = sittings
    else:
        rec["load_average_start"] = sittings[0]["load_average_start"]
    return quiet.verdict(rec)


def test_quiet_is_judged_by_the_core_count_and_by_the_other_processes():
    """Issue 30: a fixed load of 2 whatever the cores, and `other_cores` ignored, called the
    pixel record (other processes using 0.56 of 2 cores) quiet."""
    assert _judged(cores=2, start=(0.98,), end=0.93, other=0.56) == "**no**: other processes used 0.56 of 2 cores"
    assert _judged(cores=2, start=(0.97,), end=0.94, other=0.03) == "yes"
    assert _judged(cores=2, other=0.25) == "**no**: other processes used 0.25 of 2 cores"  # the threshold
    assert _judged(cores=2, other=0.24) == "yes"
    assert _judged(cores=16, start=(3.0,), end=2.5, other=1.5) == "yes"  # 3 of 16 cores busy at most
    assert _judged(cores=1, start=(1.5,), end=0.4) == "**no**: load 1.50 at the start on 1 cores"
    assert _judged(cores=2, start=(0.5, 2.2), end=2.0, other=0.6) == (
        "**no**: load 2.20 at the start on 2 cores; load 2.00 at the end on 2 cores; other processes used 0.60 of "
        "2 cores")
    assert _judged(other=None) == "unknown" and _judged(other=None, end=5.0).startswith("**no**: load 5.00")
    assert quiet.quiet_rule() == ("the 1-minute load average under the core count at the start of each sitting and "
                                 "at the end, and other processes using under 12.5% of the cores on average while "
                                 "it ran (0.25 of 2)")


def test_page_commands_name_the_default_work_dir_not_the_machines(tmp_path):
    """Issue 31: the committed page showed one machine's absolute work directory
    (/work/runs/...) in every command; it shows where the page's own command puts the runs."""
    work, out = str(tmp_path / "abs" / "work"), str(tmp_path / "docs")
    model_dir = os.path.join(work, "quickstart", "seed=0")
    quickstart = dict(_provenance("quickstart", False), kind="experiment", passed=True, commands=[
        f"python main.py --gin_file=experiments/quickstart.gin --model_dir={model_dir} --mode=train_and_eval",
        f"python -m expframe.reproduce.baseline --out={model_dir}/initial_eval.json --gin_file=x.gin"],
        runs=[{"run": "seed=0", "status": "ok", "step": 2, "final": {"top1": 0.5, "loss": 1.0}, "model_dir": model_dir,
               "thresholds": []}])
    bench = dict(_provenance("collectives", False), kind="benchmark", rows=[{"what": "x", "value": 1.0, "goal": ""}],
                 commands=[f"python benchmarks/collectives.py --out={work}/collectives/collectives.running.json"])
    inside = os.path.join(running.REPO, "runs", "elsewhere")  # running.shown made it relative to the repository
    study = dict(_provenance("sngan_batch", False), kind="study", runs=[
        dict(_study_run(16, 0.001, 0, 9.0, 0.3), model_dir=os.path.join(inside, "sngan_batch", "a"))],
        commands=["python main.py --gin_file=experiments/sngan_shapes.gin --model_dir=runs/elsewhere/sngan_batch/a"])
    for rec in (quickstart, bench, study):
        os.makedirs(os.path.join(work, running.RECORDS), exist_ok=True)
        with open(running.record_path(work, rec["name"]), "w", encoding="utf-8") as f:
            json.dump(rec, f)
    commands = {r.name: f"python -m expframe.reproduce --set={registry.set_of(r)} --only={r.name}"
                for r in registry.ALL}
    text = open(page.write(work, out, False, registry.ALL, commands, []), encoding="utf-8").read()
    sections = _sections(text)
    assert ("    python main.py --gin_file=experiments/quickstart.gin --model_dir=runs/reproduce/quickstart/seed=0 "
            "--mode=train_and_eval\n") in sections["quickstart"]
    assert "    python -m expframe.reproduce.baseline --out=runs/reproduce/quickstart/seed=0/initial_eval.json " \
           "--gin_file=x.gin\n" in sections["quickstart"]
    assert "    python benchmarks/collectives.py --out=runs/reproduce/collectives/collectives.running.json\n" in \
        sections["collectives"]
    assert "--model_dir=runs/reproduce/sngan_batch/a\n" in sections["sngan_batch"]
    assert str(tmp_path) not in text and "runs/elsewhere" not in text
    assert page.shown_commands(dict(quickstart, quick=True))[0].endswith(
        "--model_dir=runs/reproduce_quick/quickstart/seed=0 --mode=train_and_eval")


# -- --set=quick end to end -------------------------------------------------------------------------

# The default test runs one result of each kind that the page shows differently (a learning
# experiment with a threshold, a GAN with its initial FID, RL, a study, a benchmark); the
# rest of the quick set (the costliest: resnet50_throughput 112 s, scaling 80 s,
# d4pg_throughput several minutes, plan_vs_measured 4 trainer runs; the whole quick set took
# 13 minutes on 2 loaded cores in the default suite) runs only in the slow test below, for the
# default suite's time limit. Each shipped experiment's own smoke test runs in the default suite.
DEFAULT_SMOKES = ("quickstart", "sngan_shapes", "d4pg_control", "quickstart_batch", "collectives")
HEAVY_SMOKES = tuple(r.name for r in registry.results("quick") if r.name not in DEFAULT_SMOKES)


def _quick(tmp_path, data_dir, names):
    """Runs `--set=quick --only=names`; returns (argv, work dir, page path)."""
    work, out = str(tmp_path / "work"), str(tmp_path / "page")
    argv = ["--set=quick", f"--only={','.join(names)}", f"--work_dir={work}", f"--out={out}"]
    done = subprocess.run([sys.executable, "-m", "expframe.reproduce"] + argv, cwd=mr.ROOT, env=mr.env(data_dir),
                          capture_output=True, text=True, timeout=3500)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    return argv, work, os.path.join(out, page.PAGE)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_quick_set_heavy_smokes(tmp_path, data_dir):
    _, work, path = _quick(tmp_path, data_dir, HEAVY_SMOKES)
    _, _, recorded = check_page(path, registry.results("quick"))
    assert recorded == [r.name for r in registry.results("quick") if r.name in HEAVY_SMOKES]
    for name in HEAVY_SMOKES:
        rec = running.read_record(work, name)
        assert rec["complete"] and rec["rows"] and all(isinstance(r["value"], (int, float)) for r in rec["rows"])


@pytest.mark.timeout(3600)  # minutes on 2 idle cores: about 20 TensorFlow processes start and trace
def test_quick_set_runs_every_result_writes_a_valid_page_and_a_rerun_skips_them(tmp_path, data_dir, monkeypatch,
                                                                              capsys):
    """The quick set's DEFAULT_SMOKES (the rest: HEAVY_SMOKES, the slow test above)."""
    committed = os.path.join(mr.ROOT, "docs", page.PAGE)
    before = open(committed, encoding="utf-8").read() if os.path.exists(committed) else None
    every = registry.results("quick")
    results = [r for r in every if r.name not in HEAVY_SMOKES]
    argv, work, path = _quick(tmp_path, data_dir, [r.name for r in results])
    text, sections, recorded = check_page(path, every)
    assert recorded == [r.name for r in results]  # only the heavy smokes pending
    assert "**Quick smoke (`--set=quick`)" in text
    assert before == (open(committed, encoding="utf-8").read() if os.path.exists(committed) else None)
    for result in results:
        rec = running.read_record(work, result.name)
        assert rec["complete"] and rec["quick"] and rec["commit"] == HEAD, result.name
        if result.kind == "benchmark":
            assert rec["rows"] and all(isinstance(r["value"], (int, float)) for r in rec["rows"]), result.name
            continue
        for run in rec["runs"]:
            # Provenance of every main.py run: result.json, and the first line of metrics.jsonl.
            with open(os.path.join(run["model_dir"], "result.json"), encoding="utf-8") as f:
                prov = json.load(f)["provenance"]
            assert prov["commit"] == HEAD and prov["tensorflow"] and prov["keras"] and prov["machine"]["cpu"]
            assert len(prov["load_average"]) == 3 and len(prov["load_average_end"]) == 3
            with open(os.path.join(run["model_dir"], "metrics.jsonl"), encoding="utf-8") as f:
                first = json.loads(f.readline())
            assert (first["split"], first["step"], first["commit"]) == ("provenance", 0, HEAD)
    sngan = running.read_record(work, "sngan_shapes")["runs"][0]
    assert sngan["initial"]["fid"] > 0 and "fid <= 0.25 x its value at initialisation = " in sections["sngan_shapes"]

    # Rerun: every result is recorded under the same configuration, so nothing runs again.
    attempts = {r.name: os.listdir(os.path.join(work, r.name)) for r in results}
    monkeypatch.chdir(mr.ROOT)
    monkeypatch.setenv("TFDS_DATA_DIR", str(data_dir))
    capsys.readouterr()
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    assert said.count(", skipped (delete ") == len(results), said
    assert attempts == {r.name: os.listdir(os.path.join(work, r.name)) for r in results}
    check_page(path, every)

    # Another checkout: a fresh work directory restores the runs kept beside the page and
    # runs none of them again (no checkpoints are kept, so none appear).
    runs = [run["run"] for run in running.read_record(work, "quickstart_batch")["runs"]]
    assert sorted(os.listdir(os.path.join(os.path.dirname(path), "results", "runs", "quickstart_batch"))) == runs
    fresh = str(tmp_path / "fresh")
    assert cli.main(["--set=quick", "--only=quickstart_batch", f"--work_dir={fresh}",
                     f"--out={os.path.dirname(path)}"]) == 0
    said = capsys.readouterr().out
    assert said.count("finished in an earlier sitting; restored from ") == len(runs), said
    assert running.read_record(fresh, "quickstart_batch")["complete"]
    assert not any(os.path.exists(os.path.join(fresh, "quickstart_batch", run, "checkpoints")) for run in runs)


def test_a_benchmarks_finished_json_is_reused_only_by_the_same_script_and_command(tmp_path, monkeypatch, capsys):
    """A finished JSON left in the work directory (its record deleted to run it again, or a
    set stopped before the record) was reused whatever made it: a rerun after the script
    or the code it imports changed recorded the old numbers under the new commit."""
    script = tmp_path / "bench.py"
    count = tmp_path / "count"
    script.write_text("import json, os, sys\n"
                      f"c = {str(count)!r}\n"
                      "n = int(open(c).read()) + 1 if os.path.exists(c) else 1\n"
                      "open(c, 'w').write(str(n))\n"
                      "json.dump({'runs': n}, open(sys.argv[-1].split('=', 1)[1], 'w'))\n")
    monkeypatch.setattr(running, "REPO", str(tmp_path))
    monkeypatch.setattr(running.provenance, "commit", lambda root: ("c1", False))
    bench = registry.Benchmark("b", "b", "bench.py", (), (), lambda data: [])
    root = str(tmp_path / "work" / "b")
    assert running.run_benchmark(bench, root, False)[0] == {"runs": 1}
    capsys.readouterr()
    assert running.run_benchmark(bench, root, False)[0] == {"runs": 1}          # the same: reused, and said so
    assert f"b: reusing its finished output {os.path.join(root, 'b.json')} (written " in capsys.readouterr().out
    script.write_text(script.read_text() + "# edited\n")
    assert running.run_benchmark(bench, root, False)[0] == {"runs": 2}          # the script changed
    monkeypatch.setattr(running.provenance, "commit", lambda root: ("c2", False))
    assert running.run_benchmark(bench, root, False)[0] == {"runs": 3}          # the code it imports changed
    assert running.run_benchmark(bench, root, False)[0] == {"runs": 3}
