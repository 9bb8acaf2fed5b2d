"""The SN-GAN experiments through main.py (experiments/sngan_*.gin).

`sngan_shapes.gin` runs on 2 CPU replicas, shrunk by bindings: it writes FID, IS and
the samples' class accuracy into metrics.jsonl, sample grids and TensorBoard images;
killed with SIGKILL and rerun, it continues both networks, both optimizers and the
moving average exactly (deterministic mode). The ImageNet files run on TFDS mock data
with a small stand-in for the Inception graph (tests/metrics/test_feature_networks.py);
the pod variants differ from the base by the global batch only, and each runs a step.
The ImageNet file binds the official sngan_projection values its header names (the
schedule 2e-4 to generator step 400K, then linear to 0 at 450K, for both players;
the generator's batch twice the discriminator's), and the optimizers built from it
take them.
"""

import glob
import json
import os
import signal

import gin
import numpy as np
import pytest
import tensorflow as tf

from expframe import config, plot
from expframe.reproduce import baseline, registry
from tests import main_runner as mr
from tests.metrics.test_feature_networks import write_standin_graph

SHAPES = "experiments/sngan_shapes.gin"
IMAGENET = "experiments/sngan_imagenet128.gin"
PODS = {"experiments/sngan_imagenet128_pod256.gin": 256, "experiments/sngan_imagenet128_pod1024.gin": 1024,
        "experiments/sngan_imagenet128_pod2048.gin": 2048}

# Tiny networks, the session's small shapes build, a classifier trained for a few steps.
SHAPES_SMALL = (
    "shapes_input.num_train = 512", "shapes_input.num_test = 64", "shapes_classifier.num_train = 512",
    "shapes_classifier.num_test = 64", "shapes_classifier.train_steps = 10", "shapes_classifier.batch_size = 32",
    "sngan_generator.ch = 2", "sngan_generator.z_dim = 8", "sngan_discriminator.ch = 1",
    "GANTask.num_eval_samples = 16", "GANTask.inception_splits = 2", "GANTask.grid_columns = 3",
    "GANTask.ema_start_step = 0", "Trainer.global_batch_size = 8", "Trainer.train_steps = 12",
    "Trainer.steps_per_loop = 1", "Trainer.log_every_steps = 1", "Trainer.eval_every_steps = 6",
    "Trainer.checkpoint_every_steps = 4", "run_experiment.deterministic = True")
# ImageNet: mock data, the real 128x128 architecture at width 1, 2 discriminator steps.
IMAGENET_SMALL = (
    "imagenet_input.use_mock = True", "imagenet_input.mock_num_examples = 16",
    "gan_imagenet_input.shuffle_buffer_size = 16", "sngan_generator.ch = 1", "sngan_generator.z_dim = 8",
    "sngan_discriminator.ch = 1", "GANTask.disc_steps = 2", "GANTask.num_eval_samples = 8",
    "GANTask.inception_splits = 2", "GANTask.grid_classes = 2", "GANTask.grid_columns = 2",
    "Trainer.global_batch_size = 4", "Trainer.train_steps = 2", "Trainer.steps_per_loop = 1",
    "Trainer.log_every_steps = 1", "Trainer.checkpoint_every_steps = 2")


# sngan_imagenet128.gin: (binding, value, the source the header gives for it).
PUBLISHED = (
    ("GANTask.image_size", 128, "dataset size: 128"),
    ("GANTask.num_classes", 1000, "n_classes: 1000"),
    ("sngan_generator.z_dim", 128, "dim_z: 128"),
    ("sngan_generator.ch", 64, "ResNetGenerator dim_z: 128, bottom_width: 4, ch: 64"),
    ("sngan_discriminator.ch", 64, "SNResNetProjectionDiscriminator ch: 64"),
    ("sngan_generator.spectral_norm", False, "spectral norm on D only"),
    ("GANTask.loss", "hinge", "loss_type: hinge"),
    ("GANTask.disc_steps", 5, "n_dis: 5"),
    ("Trainer.global_batch_size", 64, "batchsize: 16 per GPU x 4 GPUs = 64"),
    ("GANTask.generator_batch_ratio", 2, "n_gen_samples: 32 per GPU x 4 = 128 = 2 x the D batch"),
    ("generator/keras.optimizers.Adam.beta_1", 0.0, "beta1: 0.0"),
    ("discriminator/keras.optimizers.Adam.beta_1", 0.0, "beta1: 0.0"),
    ("generator/keras.optimizers.Adam.beta_2", 0.9, "beta2: 0.9"),
    ("discriminator/keras.optimizers.Adam.beta_2", 0.9, "beta2: 0.9"),
    ("generator/keras.optimizers.Adam.epsilon", 1e-8, "_default_hyperparam.eps = 1e-8"),
    ("discriminator/keras.optimizers.Adam.epsilon", 1e-8, "_default_hyperparam.eps = 1e-8"),
    ("ConstantThenLinearDecay.initial_learning_rate", 2e-4, "adam alpha: 0.0002"),
    ("ConstantThenLinearDecay.decay_start_step", 400_000, "iteration_decay_start: 400000"),
    ("ConstantThenLinearDecay.decay_end_step", 450_000, "iteration: 450000"),
    ("ConstantThenLinearDecay.end_learning_rate", 0.0, "LinearShift('alpha', (alpha, 0.)"),
    ("Trainer.train_steps", 450_000, "iteration: 450000 (generator updates)"),
    ("run_experiment.seed", 0, "seed: 0"),
)


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("inception") / "classify_image_graph_def.pb"
    write_standin_graph(str(path))
    return str(path)


def _checkpoint(model_dir):
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    names = sorted(n for n in reader.get_variable_to_shape_map() if not n.startswith("_CHECKPOINTABLE"))
    return {n: reader.get_tensor(n) for n in names}


# Slow (about 255 s): for the default suite's time limit; the SN-GAN's run, metrics and
# page are in the default tests through the reproduce quick set (tests/test_reproduce.py).
@pytest.mark.slow
def test_shapes_runs_writes_metrics_and_grids_and_resumes_exactly_after_sigkill(data_dir, tmp_path):
    straight = tmp_path / "straight"
    done = mr.run([SHAPES], straight, data_dir, SHAPES_SMALL, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((straight / "result.json").read_text())
    assert (result["step"], result["target"], result["num_replicas"], result["global_batch_size"]) == (12, "cpu", 2, 8)
    evals = mr.metrics(straight, "eval")
    assert [r["step"] for r in evals] == [6, 12]
    for row in evals:
        assert np.isfinite(row["fid"]) and row["fid"] > 0
        assert 1.0 <= row["inception_score"] <= 10.0 and 0.0 <= row["sample_accuracy"] <= 1.0
    train = mr.metrics(straight, "train")
    assert len(train) == 12 and all(np.isfinite(r["loss"]) and np.isfinite(r["d_loss"]) for r in train)
    assert train[0]["examples_per_sec"] > 0
    for step in (6, 12):
        assert (straight / "samples" / f"step_{step}.png").is_file()
    assert glob.glob(str(straight / "eval" / "events.out.tfevents.*"))
    operative = (straight / "operative_config.gin").read_text()
    assert "sngan_generator.ch = 2" in operative and "Trainer.global_batch_size = 8" in operative
    state = _checkpoint(straight)
    for part in ("generator/", "discriminator/", "generator_optimizer/", "discriminator_optimizer/",
                 "generator_ema/"):
        assert any(n.startswith(part) for n in state), part
    assert any("sn_u" in n for n in state) and any("moving_mean" in n for n in state)
    # The curves plot shows the GAN's eval metrics.
    out = plot.plot_runs([str(straight)], out=str(tmp_path / "curves.png"))
    assert os.path.getsize(out) > 0

    killed = tmp_path / "killed"
    proc = mr.start([SHAPES], killed, data_dir, SHAPES_SMALL)
    mr.wait_for_line(proc, "step 5/12", timeout=600)
    proc.send_signal(signal.SIGKILL)  # at the latest during the evaluation at step 6
    proc.wait(timeout=60)
    assert mr.latest_step(killed) == 4
    resumed = mr.run([SHAPES], killed, data_dir, SHAPES_SMALL, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from step 4" in resumed.stdout
    assert mr.latest_step(killed) == 12
    after = _checkpoint(killed)
    assert after.keys() == state.keys()
    for name in state:
        np.testing.assert_allclose(after[name], state[name], rtol=1e-6, atol=1e-7, err_msg=name)
    timeless = lambda rows: [{k: v for k, v in r.items() if k != "examples_per_sec"} for r in rows]  # noqa: E731
    assert timeless(mr.metrics(killed)) == timeless(mr.metrics(straight))


def test_imagenet128_runs_on_mock_data_with_the_standin_inception_graph(tmp_path, graph):
    model_dir = tmp_path / "run"
    done = mr.run([IMAGENET], model_dir, tmp_path / "tfds",
                  IMAGENET_SMALL + (f"inception_network.graph_path = '{graph}'",), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((model_dir / "result.json").read_text())
    assert result["step"] == 2 and result["global_batch_size"] == 4
    assert np.isfinite(result["eval"]["fid"]) and result["eval"]["inception_score"] >= 1.0
    assert "sample_accuracy" not in result["eval"]  # Inception's 1008 classes are not the data's
    assert (model_dir / "samples" / "step_2.png").is_file()
    operative = (model_dir / "operative_config.gin").read_text()
    assert "GANTask.image_size = 128" in operative and "GANTask.num_classes = 1000" in operative


@pytest.mark.parametrize("path", sorted(PODS))
def test_pod_variant_differs_only_by_the_global_batch(path, monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    config.parse([IMAGENET], [])
    base = gin.config_str()
    config.parse([path], [])
    assert gin.query_parameter("Trainer.global_batch_size") == PODS[path]
    pod = gin.config_str().replace(f"Trainer.global_batch_size = {PODS[path]}", "Trainer.global_batch_size = 64")
    assert pod == base
    gin.clear_config()


def test_a_pod_variant_runs_a_train_step_through_main_py(tmp_path, graph):
    # One of them: the test above shows the three parse to the same configuration
    # but for the global batch, which the small bindings below replace anyway.
    model_dir = tmp_path / "run"
    done = mr.run([min(PODS, key=PODS.get)], model_dir, tmp_path / "tfds",
                  IMAGENET_SMALL + (f"inception_network.graph_path = '{graph}'", "GANTask.image_size = 32",
                                    "imagenet_input.image_size = 32", "Trainer.train_steps = 1"),
                  extra=["--mode=train"], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert mr.latest_step(model_dir) == 1


def _header(path):
    """The gin file's leading comment block as one line of words."""
    lines = []
    with open(os.path.join(mr.ROOT, path), encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[1:].strip())
    return " ".join(" ".join(lines).split())


def test_imagenet128_binds_the_published_values_its_header_names(monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    header = _header(IMAGENET)
    config.parse([IMAGENET], [])
    for binding, value, source in PUBLISHED:
        assert gin.query_parameter(binding) == value, binding
        assert source in header, (binding, source)
    # The optimizers a run builds from it (networks shrunk): both players at 2e-4 through
    # generator step 400,000, then linearly to 0 at 450,000, the discriminator counting
    # its 5 updates per step; the generator's batch 128 (the pods: twice theirs).
    import expframe as xf  # pylint: disable=import-outside-toplevel
    from expframe.tasks.gan import GANTask  # pylint: disable=import-outside-toplevel
    config.parse([IMAGENET], ["sngan_generator.ch = 1", "sngan_discriminator.ch = 1",
                              "GANTask.feature_network = None"])
    rep = xf.Replicator(target="cpu", num_replicas=1)
    task = GANTask()
    task.setup(rep, gin.query_parameter("Trainer.global_batch_size"), seed=0, deterministic=False)
    with rep.scope():
        task.build()
    assert task.generator_batch_size == 128
    generator, discriminator = task.generator_optimizer.optimizer, task.discriminator_optimizer.optimizer
    for optimizer in (generator, discriminator):
        assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.0, 0.9, 1e-8)

    def rate(optimizer, updates):
        optimizer.iterations.assign(updates)
        return float(optimizer.learning_rate)
    for step, want in ((0, 2e-4), (399_999, 2e-4), (400_000, 2e-4), (425_000, 1e-4), (449_999, 2e-4 / 50_000),
                       (450_000, 0.0)):
        assert rate(generator, step) == pytest.approx(want, rel=1e-6, abs=1e-12), step
        for j in (0, 4):  # the discriminator's 5 updates of generator step `step`
            assert rate(discriminator, 5 * step + j) == pytest.approx(want, rel=1e-6, abs=1e-12), (step, j)
    for path, batch in PODS.items():
        gin.clear_config()
        config.parse([path], ["GANTask.feature_network = None"])
        pod = GANTask()
        pod.setup(rep, gin.query_parameter("Trainer.global_batch_size"), seed=0, deterministic=False)
        assert (pod.global_batch_size, pod.generator_batch_size) == (batch, 2 * batch), path


def test_missing_inception_graph_is_a_config_error_naming_the_binding(tmp_path):
    model_dir = tmp_path / "run"
    done = mr.run([IMAGENET], model_dir, tmp_path / "tfds",
                  IMAGENET_SMALL + ("inception_network.graph_path = '/nonexistent/classify_image_graph_def.pb'",))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "inception_network.graph_path='/nonexistent/classify_image_graph_def.pb'" in lines[0]
    assert not model_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sngan_shapes_learns_class_conditional_samples(tmp_path):
    """As shipped, on 2 CPU replicas: sample class accuracy >= 0.8 and FID <= 1/4 of its
    value at initialisation (`expframe.reproduce.registry.SNGAN_SHAPES`, docs/results.md;
    `python -m pytest -q -m slow tests/test_sngan_experiments.py`)."""
    import time  # pylint: disable=import-outside-toplevel
    learning = registry.get("sngan_shapes")
    started = time.time()
    model_dir, data_dir = tmp_path / "run", tmp_path / "tfds"
    done = mr.run(learning.gin_files, model_dir, data_dir, learning.params(), timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    elapsed = time.time() - started
    last = mr.metrics(model_dir, "eval")[-1]
    # The untrained generator, evaluated as the run evaluates (the run's seed and data).
    start = baseline.initial_eval(learning.gin_files, learning.params() + (
        f"shapes_input.data_dir = '{data_dir}'", f"shapes_classifier.data_dir = '{data_dir}'"))
    grids = sorted(glob.glob(str(model_dir / "samples" / "step_*.png")), key=lambda p: int(p.rsplit("_", 1)[1][:-4]))
    print(f"sngan_shapes: step {last['step']}: sample_accuracy {last['sample_accuracy']:.3f}, fid {last['fid']:.2f} "
          f"(at initialisation {start['fid']:.2f}, accuracy {start['sample_accuracy']:.3f}), inception_score "
          f"{last['inception_score']:.2f}; {elapsed:.0f} s end to end; last grid {grids[-1]}")
    assert learning.passed(last, start), [t.text(start) for t in learning.thresholds]
