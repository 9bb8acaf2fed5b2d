"""Gin files, includes and user modules from any working directory (issue 19, items 1, 2,
6): the lookup order of expframe/gin_paths.py, package data, one-line errors. In-process."""

import os
import subprocess
import sys

import gin
import pytest

from expframe import config, configurable_list, gin_paths
from expframe.errors import ConfigError
from expframe.sweep import spec
from tests import main_runner as mr

SHIPPED = os.path.join(mr.ROOT, "experiments")


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory outside the clone; sys.path, PYTHONPATH and the search path restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv(gin_paths.SEARCH_PATH_ENV, raising=False)
    monkeypatch.setattr(gin_paths, "_module_dirs", [])
    yield tmp_path
    gin.clear_config()


def _bound(name):
    return gin.query_parameter(name)


def test_shipped_experiments_by_path_or_name_from_another_directory(elsewhere):
    for given in (os.path.join(SHIPPED, "quickstart.gin"), "quickstart", "quickstart.gin",
                  "experiments/quickstart.gin"):
        config.parse([given], [])  # includes experiments/targets/cpu.gin
        assert _bound("Replicator.target") == "cpu" and _bound("Trainer.train_steps") == 1200, given
    relative = os.path.relpath(os.path.join(SHIPPED, "sngan_shapes.gin"))
    assert relative.startswith("..")
    config.parse([relative], [])
    assert _bound("Replicator.target") == "cpu"


def test_include_order_including_file_then_shipped_then_working_directory(elsewhere):
    project = elsewhere / "project"
    (project / "configs").mkdir(parents=True)
    # The working directory (not above the project) holds a decoy of the shipped target file.
    cwd = elsewhere / "cwd"
    (cwd / "targets").mkdir(parents=True)
    (cwd / "targets" / "cpu.gin").write_text("Replicator.target = 'decoy'\n")
    os.chdir(cwd)
    (project / "configs" / "steps.gin").write_text("Trainer.train_steps = 7\n")
    (project / "configs" / "exp.gin").write_text(
        "include 'steps.gin'\n"                          # beside the including file
        "include 'configs/steps.gin'\n"                  # from the folder above it
        "include 'targets/cpu.gin'\n"                    # the shipped experiments/targets/cpu.gin
        "Trainer.global_batch_size = 8\n")
    config.parse([str(project / "configs" / "exp.gin")], [])
    assert _bound("Trainer.train_steps") == 7 and _bound("Replicator.target") == "cpu"
    # Beside the including file wins over the shipped folder.
    (project / "configs" / "targets").mkdir()
    (project / "configs" / "targets" / "cpu.gin").write_text("Replicator.target = 'mine'\n")
    config.parse(["../project/configs/exp.gin"], [])
    assert _bound("Replicator.target") == "mine"
    # An include in a --gin_param starts at the working directory.
    config.parse(["quickstart"], ["include 'targets/cpu.gin'"])
    assert _bound("Replicator.target") == "decoy"


def test_missing_files_and_syntax_errors_name_the_file_and_line(elsewhere):
    (elsewhere / "bad.gin").write_text("Trainer.train_steps = 3\nTrainer.global_batch_size = = 4\n")
    (elsewhere / "open.gin").write_text("Trainer.train_steps = [1,\n")
    (elsewhere / "outer.gin").write_text("# comment\ninclude 'bad.gin'\n")
    (elsewhere / "lost.gin").write_text("# the include is on line 3\nTrainer.train_steps = 3\ninclude 'nowhere.gin'\n")
    bad = str(elsewhere / "bad.gin")
    cases = [
        (["bad.gin"], f"{bad}:2: gin syntax error: Unable to parse value in `Trainer.global_batch_size = = 4`"),
        (["outer.gin"], f"{bad}:2: gin syntax error"),
        (["open.gin"], f"{elsewhere / 'open.gin'}:2: gin syntax error: EOF in multi-line statement"),
        (["lost.gin"], f"include 'nowhere.gin' in {elsewhere / 'lost.gin'}:3: no such file (looked in {elsewhere}"),
        (["no_such"], "--gin_file=no_such: no such file (looked in the working directory"),
    ]
    for files, expected in cases:
        with pytest.raises(ConfigError) as info:
            config.parse(files, [])
        assert str(info.value).startswith(expected), (files, str(info.value))
        assert "\n" not in str(info.value) and "quickstart" in str(info.value) or "syntax" in str(info.value)


def test_user_module_beside_the_gin_file_on_the_search_path_and_in_child_processes(elsewhere):
    project, library = elsewhere / "project", elsewhere / "library"
    project.mkdir()
    library.mkdir()
    (project / "i19_beside.py").write_text(
        "import gin\n@gin.configurable\ndef i19_beside_fn(width=3):\n    return width\n")
    (library / "i19_lib.py").write_text("import gin\n@gin.configurable\ndef i19_lib_fn(depth=1):\n    return depth\n")
    (project / "exp.gin").write_text("import i19_beside\nimport i19_lib\ni19_beside_fn.width = 5\n"
                                     "i19_lib_fn.depth = 2\n")
    with pytest.raises(ConfigError) as info:
        config.parse(["project/exp.gin"], [])
    message = str(info.value)
    assert message.startswith(f"{project / 'exp.gin'}:2: import i19_lib: no module named 'i19_lib'; looked beside "
                              f"the gin file ({project}), the gin search path (empty), PYTHONPATH"), message
    assert "--gin_search_path=DIR" in message and "EXPFRAME_GIN_PATH" in message
    gin_paths.add_search_path([str(library)])
    config.parse(["project/exp.gin"], [])
    assert gin.query_parameter("i19_beside_fn.width") == 5 and gin.query_parameter("i19_lib_fn.depth") == 2
    # A process the run starts (D4PG's actor processes parse gin.config_str() with
    # skip_unknown) imports the same modules: their folders are on its PYTHONPATH.
    saved = elsewhere / "config.gin"
    saved.write_text(gin.config_str())
    child = subprocess.run([sys.executable, "-c", (
        "import gin, sys; gin.parse_config_file(sys.argv[1], skip_unknown=True); "
        "print(gin.query_parameter('i19_beside_fn.width'), gin.query_parameter('i19_lib_fn.depth'))"),
        str(saved)], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert child.stdout.split() == ["5", "2"], child.stderr[-2000:]
    # A module the user module imports is named as such.
    (project / "i19_broken.py").write_text("import i19_not_installed\n")
    (project / "broken.gin").write_text("import i19_broken\n")
    with pytest.raises(ConfigError, match=r"broken.gin:1: import i19_broken failed: No module named "
                                          r"'i19_not_installed' \(imported by i19_broken\)"):
        config.parse(["project/broken.gin"], [])


def test_experiments_are_package_data_of_a_non_editable_install(tmp_path, monkeypatch):
    """setup.py copies experiments/ into the built package; the installed package finds
    them there (no clone beside it) and runs a shipped experiment by name."""
    import setup  # pylint: disable=import-outside-toplevel
    package = tmp_path / "site-packages" / "expframe"
    copied = setup.copy_experiments(mr.ROOT, str(package))
    shipped = sorted(os.path.relpath(os.path.join(d, f), mr.ROOT) for d, _, files in os.walk(SHIPPED)
                     for f in files if f.endswith(".gin"))
    assert sorted(copied) == shipped and "experiments/targets/cpu.gin" in copied
    monkeypatch.setattr(gin_paths, "__file__", str(package / "gin_paths.py"))
    assert gin_paths.shipped_dir() == str(package / "experiments")
    monkeypatch.chdir(tmp_path)
    assert gin_paths.resolve("quickstart") == str(package / "experiments" / "quickstart.gin")
    assert gin_paths.resolve("experiments/targets/cpu.gin",
                             including=str(package / "experiments" / "quickstart.gin")).endswith(
        os.path.join("site-packages", "expframe", "experiments", "targets", "cpu.gin"))
    with open(os.path.join(mr.ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert 'expframe = "expframe.cli:main"' in f.read()


def test_study_file_by_name_from_another_directory(elsewhere):
    includes, _, axes = spec.read_study_file("studies/quickstart_batch")
    assert includes == [os.path.join(SHIPPED, "quickstart.gin")]
    assert [a.bindings for a in axes][0][0] == "Trainer.global_batch_size"


def test_an_unknown_configurable_names_the_missing_import(elsewhere):
    """A gin file that names a user's configurable but forgot its `import` is told to add
    that import (issue 31: it was told "did you mean 'waves'?", another configurable);
    a real typo of a registered name is still offered the name."""
    project = elsewhere / "project"
    project.mkdir()
    (project / "i31_wave_data.py").write_text("import gin\n\n\n@gin.configurable\ndef i31_waves(n=3):\n    return n\n")
    (project / "i31_wave_task.py").write_text("import gin\n\n\n@gin.configurable\nclass I31WaveTask:\n    pass\n")
    (project / "forgot.gin").write_text("import i31_wave_data\ni31_waves.n = 4\nI31WaveTask.width = 2\n")
    with pytest.raises(ConfigError) as info:
        config.parse([str(project / "forgot.gin")], [])
    assert str(info.value) == (
        f"{project / 'forgot.gin'}:3: configurable 'I31WaveTask' is not registered: add `import i31_wave_task` to "
        f"{project / 'forgot.gin'} (i31_wave_task.py defines I31WaveTask), or see `python main.py "
        "--list_configurables` for the registered ones.")
    (project / "reference.gin").write_text("include 'experiments/quickstart.gin'\n"
                                           "run_experiment.task = @I31Nowhere()\n")
    with pytest.raises(ConfigError) as info:
        config.parse([str(project / "reference.gin")], [])
    assert str(info.value) == (
        f"{project / 'reference.gin'}:2: configurable 'I31Nowhere' is not registered: add `import <the module that "
        f"defines it>` to {project / 'reference.gin'}, or see `python main.py --list_configurables` for the "
        "registered ones.")
    with pytest.raises(ConfigError, match=r"^--gin_param='I31WaveTask.width = 2': configurable 'I31WaveTask' is not "
                                          r"registered: add `import <the module that defines it>` as "
                                          r"--gin_param='import <the module that defines it>'"):
        config.parse([], ["I31WaveTask.width = 2"])
    with pytest.raises(ConfigError, match=r"^--gin_param='Trainr.train_steps = 1': unknown configurable 'Trainr'; "
                                          r"did you mean 'Trainer'\? \(see"):
        config.parse(["quickstart"], ["Trainr.train_steps = 1"])


def test_list_configurables_shows_a_classs_own_docstring(elsewhere):
    """A user's Task without a docstring read as the base class's ("Trains `model` on
    `dataset` ..."): each configurable shows its own first line, or (no docstring)."""
    (elsewhere / "i31_tasks.py").write_text(
        "import gin\nfrom expframe.tasks.classification import ClassificationTask\n\n\n"
        "@gin.configurable\nclass I31Bare(ClassificationTask):\n    pass\n\n\n"
        "@gin.configurable\nclass I31Told(ClassificationTask):\n    \"\"\"Waves, told apart.\n\n"
        "    More.\"\"\"\n")
    (elsewhere / "tasks.gin").write_text("import i31_tasks\n")
    config.parse([str(elsewhere / "tasks.gin")], [])
    listed = configurable_list.format_list(configurable_list.configurables("i31_tasks"))
    assert "I31Bare  [i31_tasks.I31Bare]  (no docstring)\n" in listed, listed
    assert "I31Told  [i31_tasks.I31Told]  Waves, told apart.\n" in listed, listed
    trainer = configurable_list.configurables("expframe.trainer.Trainer")[0]
    assert trainer.summary == "Runs a Task on a Replicator: train, evaluate, checkpoint, log."
