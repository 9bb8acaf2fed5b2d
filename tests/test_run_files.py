"""metrics.jsonl on resume (issue 9, item 11): records past the resumed step go, a torn
last line (a crash while appending it) is dropped with a line saying so, any other
unreadable line is an error that leaves the file as it was. resolved.json (issue 30):
what 'auto' resolved to; a resume that would resolve it differently is refused."""

import json
import os

import gin
import keras
import pytest

from expframe import atomic_files, config, experiment, run_files
from expframe.errors import ConfigError, RunError
from expframe.replicator import auto_settings, autotune
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


def test_a_resume_keeps_a_continuous_evaluators_eval_records(tmp_path):
    evals = [{"step": s, "split": "eval", "top1": s / 10} for s in (2, 4)]
    text = "".join(json.dumps(r) + "\n" for r in RECORDS + evals)
    _write(tmp_path, text)
    RunFiles(str(tmp_path)).start("config", resumed_step=2, own_eval=False)  # --mode=train beside an evaluator
    assert _steps(tmp_path) == [1, 2, 2, 4]
    _write(tmp_path, text)
    RunFiles(str(tmp_path)).start("config", resumed_step=2, own_eval=True)  # train_and_eval: its own evals
    assert _steps(tmp_path) == [1, 2, 2]


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


# -- what 'auto' resolved to (issue 30) ------------------------------------------------

REGRESSION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "regression",
                          "regression.gin")
TINY = ("run_experiment.precision = 'auto'", "Trainer.train_steps = 2", "Trainer.steps_per_loop = 1",
        "Trainer.log_every_steps = 1", "Trainer.eval_every_steps = None", "Trainer.eval_steps = 1",
        "Trainer.checkpoint_every_steps = 2", "sine_waves.num_train = 256", "sine_waves.num_test = 64",
        "mlp.hidden = 8")


def _seed_cache(directory, choice):
    """The measured-choice cache says `choice` for this machine's CPU (the probe's result, faked)."""
    key = auto_settings.cache_key("run_experiment.precision", "/device:CPU:0")
    seconds = {"float32": 1.0, "mixed_bfloat16": 0.5 if choice == "mixed_bfloat16" else 2.0}
    atomic_files.write_json(os.path.join(directory, autotune.CACHE_FILE), {key: {"choice": choice,
                                                                               "seconds": seconds}},
                            make_dirs=True)


def _run(model_dir, allow_config_change=False):
    """main.py's path in this process: parse, run_experiment (mode train)."""
    try:
        text = config.parse([REGRESSION], TINY)
        return experiment.run_experiment(model_dir=str(model_dir), mode="train", config_text=text,
                                         allow_config_change=allow_config_change)
    finally:
        gin.clear_config()
        keras.mixed_precision.set_global_policy("float32")


def test_a_resume_that_would_resolve_auto_differently_is_refused(tmp_path, monkeypatch, capsys):
    """A run trained at mixed_bfloat16 ('auto', as measured) and resumed after the cache
    changed to float32 is refused (exit 2, one line naming both values and the flag),
    and nothing is written; --allow_config_change goes on, and records float32."""
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "cache"))
    model_dir = tmp_path / "run"
    _seed_cache(str(tmp_path / "cache"), "mixed_bfloat16")
    assert _run(model_dir)["step"] == 2
    resolved = json.loads((model_dir / run_files.RESOLVED).read_text(encoding="utf-8"))
    assert resolved == {"run_experiment.precision": "mixed_bfloat16", "Replicator.jit_compile": False}
    before = sorted(p.name for p in model_dir.iterdir()), (model_dir / "metrics.jsonl").read_text(encoding="utf-8")

    _seed_cache(str(tmp_path / "cache"), "float32")  # another machine's answer, or a remeasurement
    with pytest.raises(ConfigError) as caught:
        _run(model_dir)
    message = str(caught.value).splitlines()[0]  # what main.py prints (gin appends where it was raised)
    assert caught.value.exit_code == 2, message
    assert message.startswith(f"{model_dir / run_files.RESOLVED}: run_experiment.precision resolves to 'float32' "
                              "in this run, but the run in "), message
    assert "trained with 'mixed_bfloat16'" in message and "--allow_config_change" in message, message
    after = sorted(p.name for p in model_dir.iterdir()), (model_dir / "metrics.jsonl").read_text(encoding="utf-8")
    assert after == before

    capsys.readouterr()
    assert _run(model_dir, allow_config_change=True)["step"] == 2
    resolved = json.loads((model_dir / run_files.RESOLVED).read_text(encoding="utf-8"))
    assert resolved["run_experiment.precision"] == "float32"


def test_check_resolved_names_the_xla_choice_and_a_damaged_record(tmp_path):
    choices = {"run_experiment.precision": "float32", "Replicator.jit_compile": True}
    run_files.check_resolved(str(tmp_path), choices)  # a new run (no record) passes
    RunFiles(str(tmp_path)).start("config", 0, "parsed", choices)
    run_files.check_resolved(str(tmp_path), dict(choices))  # the same choices pass
    with pytest.raises(ConfigError, match=r"Replicator.jit_compile resolves to False in this run, but the run in "
                                          r".* was trained with True .*bind Replicator.jit_compile = True and pass "
                                          r"--allow_config_change"):
        run_files.check_resolved(str(tmp_path), {**choices, "Replicator.jit_compile": False})
    (tmp_path / run_files.RESOLVED).write_text("[1]", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"resolved.json cannot be read \(not a JSON object but list\); delete it"):
        run_files.check_resolved(str(tmp_path), choices)
