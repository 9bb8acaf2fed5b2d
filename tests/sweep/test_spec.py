"""Study files and --sweep/--zip flags, their expansion into runs, and validation."""

import glob
import os

import gin
import pytest

from expframe.errors import ConfigError
from expframe.sweep import spec
from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    yield
    gin.clear_config()


def _values(study):
    return [dict(run.values) for run in study.runs()]


def test_grid_is_the_product_last_axis_fastest():
    study = spec.build_study(gin_files=[QUICKSTART], sweeps=[
        "Trainer.global_batch_size=[16, 32, 64]", "run_experiment.seed=[0, 1]"])
    assert [(v["Trainer.global_batch_size"], v["run_experiment.seed"]) for v in _values(study)] == [
        ("16", "0"), ("16", "1"), ("32", "0"), ("32", "1"), ("64", "0"), ("64", "1")]
    assert [r.index for r in study.runs()] == list(range(6))
    assert study.runs()[3].name == "global_batch_size=32,seed=1"
    assert study.runs()[3].gin_params == ["Trainer.global_batch_size = 32", "run_experiment.seed = 1"]
    assert study.name == "quickstart_study"


def test_zip_moves_bindings_together_and_crosses_the_grid():
    study = spec.build_study(gin_files=[QUICKSTART], sweeps=["run_experiment.seed=[0, 1]"], zips=[
        "Trainer.global_batch_size=[64, 128]", "keras.optimizers.Adam.learning_rate=[1e-3, 2e-3]"])
    got = [(v["Trainer.global_batch_size"], v["keras.optimizers.Adam.learning_rate"], v["run_experiment.seed"])
           for v in _values(study)]
    assert got == [("64", "0.001", "0"), ("128", "0.002", "0"), ("64", "0.001", "1"), ("128", "0.002", "1")]


def test_study_file(tmp_path):
    path = tmp_path / "s.gin"
    path.write_text(
        "# a study\ninclude 'experiments/quickstart.gin'\n"
        "Trainer.train_steps = 10  # fixed\n"
        "zip/Trainer.global_batch_size = [64, 128]\n"
        "sweep/resnet.norm = [@SyncBatchNorm, @keras.layers.BatchNormalization]\n"
        "zip/keras.optimizers.Adam.learning_rate = [1e-3, 2e-3]\n"
        "zip_other/shapes_input.image_size = [32, 64]\n"
        "zip_other/resnet.input_shape = [(32, 32, 3), (64, 64, 3)]\n"
        "sweep/scoped/Adam.beta_1 = [0.8, 0.9]\n")
    study = spec.build_study(str(path))
    assert study.name == "s" and study.gin_files == [QUICKSTART] and study.gin_params == ["Trainer.train_steps = 10"]
    # Axes in the file's order; a zip group where its first binding is.
    assert [a.bindings for a in study.axes] == [
        ("Trainer.global_batch_size", "keras.optimizers.Adam.learning_rate"), ("resnet.norm",),
        ("shapes_input.image_size", "resnet.input_shape"), ("scoped/Adam.beta_1",)]
    assert study.axes[1].values == (("@SyncBatchNorm",), ("@keras.layers.BatchNormalization",))
    assert study.axes[2].values[1] == ("64", "(64, 64, 3)")
    assert study.axes[0].origin.endswith("s.gin:4 (zip/)")
    runs = study.runs()
    assert len(runs) == 2 * 2 * 2 * 2
    assert runs[0].name.startswith("global_batch_size=64,learning_rate=0.001,norm=SyncBatchNorm,image_size=32,"
                                   "input_shape=")
    assert "scoped/Adam.beta_1 = 0.8" in runs[0].gin_params
    texts = spec.validate(study)  # every run parses with expframe.config
    assert set(texts) == {r.name for r in runs}
    assert "resnet.input_shape = (64, 64, 3)" in texts[runs[-1].name]


def test_command_line_replaces_the_study_files_sweep(tmp_path):
    path = tmp_path / "s.gin"
    path.write_text("include 'experiments/quickstart.gin'\nzip/Trainer.global_batch_size = [64, 128]\n"
                    "zip/Trainer.train_steps = [20, 10]\nsweep/run_experiment.seed = [0, 1, 2]\n")
    study = spec.build_study(str(path), sweeps=["run_experiment.seed=[5]"],
                             zips=["Trainer.global_batch_size=[16]", "Trainer.train_steps=[2]"])
    assert [r.name for r in study.runs()] == ["global_batch_size=16,train_steps=2,seed=5"]
    with pytest.raises(ConfigError, match=r"zips Trainer.global_batch_size, Trainer.train_steps together"):
        spec.build_study(str(path), zips=["Trainer.global_batch_size=[16]"])


@pytest.mark.parametrize("kwargs,message", [
    ({"sweeps": ["Trainer.train_steps=5"]}, r"Trainer.train_steps = 5 is not a list of values"),
    ({"sweeps": ["Trainer.train_steps=[]"]}, r"is not a list of values"),
    ({"sweeps": ["Trainer.train_steps=[5, 5]"]}, r"Trainer.train_steps = 5 comes twice"),
    ({"sweeps": ["Trainer.train_steps=[5,"]}, r"--sweep='Trainer.train_steps=\[5,': EOF in multi-line statement"),
    ({"sweeps": ["Trainer.train_steps"]}, r"--sweep='Trainer.train_steps': .*expected ':' or '='"),
    ({"sweeps": ["include 'x.gin'"]}, r"expected one binding and its values"),
    ({"zips": ["Trainer.train_steps=[1, 2]", "run_experiment.seed=[0]"]},
     r"need as many values each \(Trainer.train_steps has 2, run_experiment.seed has 1\)"),
    ({"sweeps": ["Trainer.train_steps=[1, 2]"], "zips": ["Trainer.train_steps=[3, 4]"]}, r"swept twice"),
    ({"sweeps": ["Trainer.train_steps=[1, 2]"], "gin_params": ["Trainer.train_steps = 3"]},
     r"'Trainer.train_steps = 3' binds Trainer.train_steps, which the study sweeps"),
    ({}, r"nothing to sweep"),
    ({"gin_files": [], "sweeps": ["Trainer.train_steps=[1]"]}, r"no base experiment"),
])
def test_structural_errors_are_one_line(kwargs, message):
    kwargs = {"gin_files": [QUICKSTART], **kwargs}
    with pytest.raises(ConfigError, match=message) as e:
        spec.build_study(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("Trainer.train_steps = 3\ninclude 'experiments/quickstart.gin'\n", r"s.gin:2: include .* after a binding"),
    ("include 'experiments/quickstart.gin'\nimport os\n", r"s.gin:2: imports are not read"),
    ("include 'experiments/quickstart.gin'\nsweep/Trainer.train_steps = 3\n", r"s.gin:2: .* not a list"),
    ("include 'experiments/quickstart.gin'\nsweep/Trainer.train_steps = [1,\n", r"s.gin:\d+: "),
])
def test_study_file_errors_name_the_line(tmp_path, text, message):
    (tmp_path / "s.gin").write_text(text)
    with pytest.raises(ConfigError, match=message):
        spec.build_study(str(tmp_path / "s.gin"))


@pytest.mark.parametrize("sweep,message", [
    ("Trainer.train_step=[1, 2]", r"--sweep='Trainer.train_step=\[1, 2\]': swept Trainer.train_step = 1: .*"
                                  r"'Trainer' has no parameter 'train_step'; did you mean 'train_steps'"),
    ("Trainr.train_steps=[1]", r"unknown configurable 'Trainr'"),
])
def test_validate_names_a_bad_swept_binding(sweep, message):
    study = spec.build_study(gin_files=[QUICKSTART], sweeps=["run_experiment.seed=[0, 1]", sweep])
    with pytest.raises(ConfigError, match=message) as e:
        spec.validate(study)
    assert "\n" not in str(e.value)


def test_validate_names_a_bad_base():
    study = spec.build_study(gin_files=[QUICKSTART], gin_params=["Trainer.nope = 1"],
                             sweeps=["run_experiment.seed=[0]"])
    with pytest.raises(ConfigError, match=r"base of study 'quickstart_study': .*Trainer.nope"):
        spec.validate(study)


def test_shipped_quickstart_batch_study():
    study = spec.build_study("experiments/studies/quickstart_batch.gin")
    runs = study.runs()
    assert len(runs) == 8 and study.gin_files == [QUICKSTART]
    for run in runs:
        v = dict(run.values)
        batch, lr, steps = int(v["Trainer.global_batch_size"]), float(v["keras.optimizers.Adam.learning_rate"]), \
            int(v["Trainer.train_steps"])
        assert lr == pytest.approx(2e-3 * batch / 128)  # the quickstart's rate, scaled linearly
        assert batch * steps == 81_920  # the same number of examples for every batch
    assert sorted({dict(r.values)["Trainer.global_batch_size"] for r in runs}, key=int) == ["64", "128", "256", "512"]
    assert {dict(r.values)["run_experiment.seed"] for r in runs} == {"0", "1"}
    assert runs[0].name == "global_batch_size=64,learning_rate=0.001,train_steps=1280,seed=0"
    texts = spec.validate(study)
    assert len(texts) == 8


def test_shipped_resnet50_scaling_study():
    study = spec.build_study("experiments/studies/resnet50_scaling.gin")
    points = [(int(dict(r.values)["Replicator.num_replicas"]), int(dict(r.values)["Trainer.global_batch_size"]))
              for r in study.runs()]
    assert points == [(1, 8), (2, 16), (4, 32), (8, 64)]  # 8 images per replica throughout
    spec.validate(study)
    config_text = spec.validate(study)["num_replicas=8,global_batch_size=64"]
    # What the files parse to, includes expanded (resnet50_imagenet_fake.gin's bindings).
    assert "Replicator.num_replicas = 8" in config_text and "imagenet_input.use_mock = True" in config_text


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(mr.ROOT, "experiments", "studies", "*"))))
def test_every_shipped_study_is_gin_and_validates(path):
    assert path.endswith(".gin")
    study = spec.build_study(os.path.relpath(path, mr.ROOT))
    assert len(spec.validate(study)) == len(study.runs()) >= 2
    assert open(path).read().startswith("# Study: ")  # a header that says what it studies
