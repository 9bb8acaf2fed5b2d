"""Finished runs kept beside the results page (expframe/reproduce/kept.py): a study of
several hours spans checkouts, each restoring the runs finished in another and never
running them again; a kept run of another configuration is not restored, and is set aside."""

import json
import os

from expframe.reproduce import __main__ as cli
from expframe.reproduce import kept, page, registry, running
from expframe.sweep import runner, spec

STUDY = spec.Study("s", ["experiments/quickstart.gin"], [],
                   [spec.Axis(("run_experiment.seed",), (("0",), ("1",), ("2",)), "test")])
NAMES = [run.name for run in STUDY.runs()]
TEXTS = {name: f"run_experiment.seed = {i}\n" for i, name in enumerate(NAMES)}


def _finished_run(root, name, episode_return, wall=600.0, text=None):
    model_dir = os.path.join(root, name)
    os.makedirs(os.path.join(model_dir, "checkpoints"))
    with open(os.path.join(model_dir, "checkpoints", "ckpt-1.data"), "wb") as f:
        f.write(b"\0" * 1000)
    files = {"parsed_config.gin": text or TEXTS[name], "config.gin": "# as given\n",
             "operative_config.gin": "# operative\n",
             "metrics.jsonl": json.dumps({"split": "eval", "step": 10, "episode_return": episode_return}) + "\n",
             "result.json": json.dumps({"eval": {"episode_return": episode_return}, "step": 10, "wall_time_s": wall})}
    for file, text in files.items():
        with open(os.path.join(model_dir, file), "w", encoding="utf-8") as f:
            f.write(text)
    os.makedirs(os.path.join(root, runner.LOGS), exist_ok=True)
    with open(os.path.join(root, runner.LOGS, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump({"name": name, "attempts": [{"exit_code": 0, "wall_time_s": wall, "error": ""}]}, f)


def test_finished_runs_are_kept_without_checkpoints_and_restored_in_another_checkout(tmp_path):
    first, second, store = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "kept")
    _finished_run(first, NAMES[0], 612.5)
    os.makedirs(os.path.join(first, NAMES[1]))  # started, not finished: not kept
    with open(os.path.join(first, NAMES[1], "parsed_config.gin"), "w", encoding="utf-8") as f:
        f.write(TEXTS[NAMES[1]])
    assert kept.keep(STUDY, first, store, TEXTS) == [NAMES[0]]
    assert kept.keep(STUDY, first, store, TEXTS) == []  # kept already
    assert sorted(os.listdir(store)) == [NAMES[0]]
    assert sorted(os.listdir(os.path.join(store, NAMES[0]))) == sorted(kept.FILES + (kept.ATTEMPTS,))

    # Another checkout: an empty work directory, and a run begun there that must not be touched.
    os.makedirs(os.path.join(second, NAMES[2]))
    assert kept.restore(STUDY, second, store, TEXTS) == [NAMES[0]]
    restored = os.path.join(second, NAMES[0])
    assert runner.is_finished(restored, TEXTS[NAMES[0]]) and not os.path.exists(os.path.join(restored, "checkpoints"))
    assert runner.read_record(second, NAMES[0])["attempts"][0]["wall_time_s"] == 600.0
    assert os.listdir(os.path.join(second, NAMES[2])) == [] and not os.path.exists(os.path.join(second, NAMES[1]))
    assert kept.restore(STUDY, second, store, TEXTS) == []  # there already
    assert not [n for n in os.listdir(second) if n.endswith(".restoring")]

    # A gin file edited since: the kept run is of another configuration and runs afresh.
    edited = dict(TEXTS, **{NAMES[0]: "run_experiment.seed = 0\nTrainer.train_steps = 5\n"})
    assert kept.restore(STUDY, str(tmp_path / "c"), store, edited) == []
    assert kept.finished(store) == [{"run": NAMES[0], "step": 10, "eval": {"episode_return": 612.5},
                                     "wall_time_s": 600.0}]
    # Before a study runs, its kept runs of another configuration are set aside: the page
    # then lists none of them as finished; they stay under stale/ for reference.
    assert kept.set_aside_stale(STUDY, store, TEXTS) == []
    assert kept.set_aside_stale(STUDY, store, edited) == [NAMES[0]]
    assert kept.finished(store) == []
    assert runner.is_finished(os.path.join(store, kept.STALE, NAMES[0]), TEXTS[NAMES[0]])


def test_sittings_kept_beside_the_page_carry_a_pending_study_to_another_checkout(tmp_path, monkeypatch):
    result = registry.D4PG_PIXELS_ACTORS
    out = str(tmp_path / "docs")
    store = kept.folder(out, result.name)
    monkeypatch.setattr(running, "signature", lambda result, quick: "sig-a")

    def stopped(*args):
        raise running.Stopped("stopped; rerun the same command to resume it")
    monkeypatch.setattr(running, "_run_parts", stopped)
    try:
        running.run(result, str(tmp_path / "work1"), False, "python -m expframe.reproduce", kept_dir=store)
    except running.Stopped:
        pass
    assert [s["ended"] for s in kept.read_sittings(store)] == ["stopped"]
    _finished_run(store, "num_actors=1,num_replicas=1,seed=0", 301.25, wall=1800.0, text="# its config\n")

    # The second checkout has no work directory: the page still shows the sitting and the run.
    commands = {r.name: f"python -m expframe.reproduce --set={registry.set_of(r)} --only={r.name}"
                for r in registry.ALL}
    text = open(page.write(str(tmp_path / "work2"), out, False, registry.ALL, commands, []), encoding="utf-8").read()
    assert "| [d4pg_pixels_actors](#d4pg_pixels_actors) | pending (started: 1 sitting so far" in text
    assert "Finished so far (1 run, kept in `results/runs/d4pg_pixels_actors/`; the final eval):" in text
    assert "| num_actors=1,num_replicas=1,seed=0 | 10 | 301.2 | 30.0 min |" in text

    seen = []

    def completes(result, work, quick, command, parallel, root, started, kept_dir):
        seen.append(kept_dir)
        return {"name": result.name, "kind": "study", "runs": [], "complete": True}
    monkeypatch.setattr(running, "_run_parts", completes)
    rec = running.run(result, str(tmp_path / "work2"), False, "python -m expframe.reproduce", kept_dir=store)
    assert [s["ended"] for s in rec["sittings"]] == ["stopped", "complete"] and seen == [store]
    assert kept.read_sittings(store) == [] and not os.path.exists(os.path.join(store, kept.SITTINGS))


def test_page_only_keeps_the_runs_finished_in_the_work_directory(tmp_path, capsys):
    """`--page_only` runs nothing; it keeps runs made by hand with the study's exact
    commands (finished under its configuration) beside the page."""
    result = registry.QUICKSTART_BATCH
    study = running.study_for(result, True)
    texts = spec.validate(study)
    work, out = str(tmp_path / "work"), str(tmp_path / "page")
    names = list(texts)
    _finished_run(os.path.join(work, result.name), names[0], 0.5, text=texts[names[0]])
    assert cli.main(["--set=quick", f"--only={result.name}", "--page_only", f"--work_dir={work}",
                     f"--out={out}"]) == 0
    assert f"{result.name}: kept {names[0]} in " in capsys.readouterr().out
    assert sorted(os.listdir(kept.folder(out, result.name))) == [names[0]]
    assert not os.path.exists(os.path.join(kept.folder(out, result.name), names[0], "checkpoints"))
