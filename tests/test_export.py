"""Export for serving (expframe/export.py, `Task.serving`): each family's SavedModel, loaded
in a fresh Python process that never imports expframe, gives the framework model's outputs
(within 1e-5) on fixed inputs; one export comes from a checkpoint written by 2 replicas.
Also: the base Task's error, a refused non-empty export_dir, and docs/extending.md's
user-task example."""

import functools
import importlib
import os
import re
import subprocess
import sys
import textwrap

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import expframe as xf
from expframe import config, export
from expframe.errors import ConfigError
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from expframe.models.pixel_encoder import drq_encoder
from expframe.models.vit import ViT
from expframe.replicator import mesh
from expframe.replicator.mesh_optimizer import MeshAdam
from expframe.rl.environments import control_suite
from expframe.tasks import gan_standing
from expframe.tasks.base import Task
from expframe.tasks.classification import ClassificationTask
from expframe.tasks.d4pg import D4PGTask
from expframe.tasks.mesh_classification import MeshClassificationTask
from tests import main_runner as mr
from tests.tasks import test_gan

ATOL = 1e-5
RNG = np.random.default_rng(0)

# Loads the SavedModel with TensorFlow alone, calls every signature on the inputs of the
# .npz ("signature/argument"), writes the outputs ("signature/output").
LOADER = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    export_dir, inputs, outputs = sys.argv[1:]
    loaded = tf.saved_model.load(export_dir)
    feeds, got = np.load(inputs), {}
    for name, fn in loaded.signatures.items():
        args = {k.split("/", 1)[1]: tf.constant(feeds[k]) for k in feeds.files if k.startswith(name + "/")}
        got.update({f"{name}/{key}": value.numpy() for key, value in fn(**args).items()})
    assert "expframe" not in sys.modules, sorted(m for m in sys.modules if m.startswith("expframe"))
    np.savez(outputs, **got)
""")


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def serve_elsewhere(export_dir, inputs, tmp_path):
    """{"signature/output": value} from the SavedModel loaded in a fresh process, called on `inputs`."""
    np.savez(tmp_path / "inputs.npz", **inputs)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOADER, str(export_dir), str(tmp_path / "inputs.npz"),
                           str(tmp_path / "outputs.npz")], cwd=tmp_path, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "outputs.npz") as out:
        return {k: out[k] for k in out.files}


def assert_served(task, inputs, expected, tmp_path):
    """Exports `task`, serves `inputs` elsewhere, compares with `expected` ("signature/output":
    value, or a function giving them after the export); returns the largest absolute difference."""
    info = export.export_saved_model(task, str(tmp_path / "export"))
    expected = expected() if callable(expected) else expected
    assert info["export_dir"] == str(tmp_path / "export")
    assert set(info["signatures"]) == {k.split("/")[0] for k in expected}
    assert all(sorted(k.split("/")[1] for k in expected if k.startswith(name + "/")) == signature["outputs"]
               for name, signature in info["signatures"].items())
    got = serve_elsewhere(tmp_path / "export", inputs, tmp_path)
    assert sorted(got) == sorted(expected)
    worst = 0.0
    for key, want in expected.items():
        assert got[key].dtype == np.asarray(want).dtype and got[key].shape == np.shape(want), key
        np.testing.assert_allclose(got[key], want, atol=ATOL, rtol=0, err_msg=key)
        worst = max(worst, float(np.abs(got[key].astype(np.float64) - want).max()))
    print(f"max abs difference {worst:.3g}")
    return worst


def classifier_outputs(logits, prefix="serving_default/"):
    logits = np.asarray(logits, np.float32)
    probabilities = tf.nn.softmax(logits).numpy()
    k = min(5, logits.shape[-1])
    order = np.argsort(-probabilities, axis=-1, kind="stable")[:, :k].astype(np.int32)
    return {prefix + "logits": logits, prefix + "probabilities": probabilities, prefix + "top_k_classes": order,
            prefix + "top_k_probabilities": np.take_along_axis(probabilities, order, -1)}


# -- the contract ---------------------------------------------------------------------------


def test_the_base_task_declares_no_serving_signature(tmp_path):
    class NoServing(Task):
        pass

    with pytest.raises(ConfigError) as e:
        export.export_saved_model(NoServing(), str(tmp_path / "export"))
    assert str(e.value) == "NoServing declares no serving signature: override Task.serving (docs/extending.md)."
    assert os.listdir(tmp_path) == []


class _Identity(Task):
    def serving(self):
        fn = tf.function(lambda x: {"y": x + 1.0}, input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        return {"serving_default": fn}


def test_refuses_a_non_empty_export_dir_and_replaces_an_empty_one(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--export_dir=.*full exists and is not empty"):
        export.export_saved_model(_Identity(), str(full))
    assert os.listdir(full) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["full"]  # no temporary left
    (tmp_path / "empty").mkdir()
    info = export.export_saved_model(_Identity(), str(tmp_path / "empty"))
    assert info["signatures"] == {"serving_default": {"inputs": {"x": {"dtype": "float32", "shape": [None]}},
                                                      "outputs": ["y"]}}
    assert "saved_model.pb" in os.listdir(tmp_path / "empty") and sorted(os.listdir(tmp_path)) == ["empty", "full"]


def test_refuses_signatures_that_break_the_contract(tmp_path):
    class NoDefault(Task):
        def serving(self):
            return {"other": _Identity().serving()["serving_default"]}

    class NoSignature(Task):
        def serving(self):
            return {"serving_default": tf.function(lambda x: {"y": x})}

    with pytest.raises(ConfigError, match="NoDefault.serving must return a dict of signatures holding 'serving_"):
        export.export_saved_model(NoDefault(), str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"NoSignature.serving\(\)\['serving_default'\] is not a tf.function with"):
        export.export_saved_model(NoSignature(), str(tmp_path / "b"))
    assert os.listdir(tmp_path) == []


# -- the families ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, data_dir):
    """experiments/quickstart.gin shrunk (tests/main_runner.SMALL): 6 steps on 2 replicas."""
    model_dir = tmp_path_factory.mktemp("quickstart") / "run"
    done = mr.run(["experiments/quickstart.gin"], model_dir, data_dir, mr.SMALL + ("Replicator.num_replicas = 2",))
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"num_replicas": 2' in (model_dir / "result.json").read_text()
    return model_dir


def _quickstart_task(model_dir, data_dir):
    """The run's ClassificationTask (its parsed config), built on 1 replica."""
    config.parse([str(model_dir / "parsed_config.gin")],
                 ["Replicator.num_replicas = 1", f"shapes_input.data_dir = '{data_dir}'"])
    rep = xf.Replicator()
    task = ClassificationTask()
    task.setup(rep, 16, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    return task


def _restored_quickstart(model_dir, data_dir, images):
    """(task, logits of `images`): the run's last checkpoint (step 6) read into a 1-replica task."""
    task = _quickstart_task(model_dir, data_dir)
    initial = task.model(images, training=False).numpy()
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert path.endswith("ckpt-6")
    tf.train.Checkpoint(model=task.model, optimizer=task.optimizer).read(path).expect_partial() \
        .assert_existing_objects_matched()
    logits = task.model(images, training=False).numpy()
    assert np.abs(logits - initial).max() > 1e-3  # the checkpoint's weights, not the initial ones
    return task, logits


def test_classification_from_a_checkpoint_of_two_replicas(quickstart_run, data_dir, tmp_path):
    images = RNG.normal(size=(5, 32, 32, 3)).astype(np.float32)
    task, logits = _restored_quickstart(quickstart_run, data_dir, images)
    assert_served(task, {"serving_default/image": images}, classifier_outputs(logits), tmp_path)


def test_main_mode_export_of_the_two_replica_run(quickstart_run, data_dir, tmp_path):
    """`main.py --mode=export`: exit 0, the SavedModel at --export_dir, served elsewhere as the checkpoint."""
    out = tmp_path / "served" / "quickstart"
    done = mr.run(["experiments/quickstart.gin"], quickstart_run, data_dir,
                  mr.SMALL + ("Replicator.num_replicas = 2",), extra=["--mode=export", f"--export_dir={out}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported step 6 (latest) to {out}" in done.stdout, done.stdout[-2000:]
    assert (out / "saved_model.pb").is_file()
    images = RNG.normal(size=(3, 32, 32, 3)).astype(np.float32)
    _, logits = _restored_quickstart(quickstart_run, data_dir, images)
    got = serve_elsewhere(out, {"serving_default/image": images}, tmp_path)
    for key, want in classifier_outputs(logits).items():
        np.testing.assert_allclose(got[key], want, atol=ATOL, rtol=0, err_msg=key)


def test_mesh_vit_saves_plain_variables(tmp_path):
    rep = xf.Replicator(target="mesh", mesh_shape={"batch": 2, "model": 2})
    task = MeshClassificationTask(model=functools.partial(ViT, num_classes=4, image_size=8, patch_size=4, width=16,
                                                          depth=1, num_heads=4, mlp_dim=32, stem_widths=(4,)),
                                  dataset=lambda **_: None, optimizer=functools.partial(MeshAdam, learning_rate=0.05))
    task.setup(rep, 4, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    images = RNG.normal(size=(4, 8, 8, 3)).astype(np.float32)
    batch = {"image": tf.constant(images), "label": tf.range(4)}
    rep.run(tf.function(task.train_step), batch)  # the biases move away from their zeros
    logits = mesh.to_host(rep.run(tf.function(task.model), batch["image"]))
    assert_served(task, {"serving_default/image": images}, classifier_outputs(logits), tmp_path)

    class Sharded(Task):  # a signature that reads the DTensor variables themselves
        def serving(self):
            return {"serving_default": tf.function(lambda x: {"y": x + task.model.head_bias},
                                                   input_signature=[tf.TensorSpec([4], tf.float32, name="x")])}

    with pytest.raises(ConfigError, match=r"Sharded.serving\(\)\['serving_default'\] reads the DTensor variable"):
        export.export_saved_model(Sharded(), str(tmp_path / "sharded"))
    assert not (tmp_path / "sharded").exists()


def test_gan_samples_with_the_standing_statistics_and_serves_the_online_generator(tmp_path):
    _, task, _ = test_gan.train(1, steps=2)
    z = RNG.normal(size=(6, test_gan.Z)).astype(np.float32)
    labels = np.arange(6, dtype=np.int32) % test_gan.CLASSES
    inputs = {f"{name}/{key}": value for name in ("serving_default", "online")
              for key, value in (("z", z), ("label", labels))}
    copied = task.sampler([z, labels], training=False).numpy()

    def expected():  # after the export, which estimated the standing statistics
        standing = task.standing_statistics
        values = [(v, standing[v.path]) for norm in gan_standing.batch_norms(task.sampler)
                  for v in (norm.moving_mean, norm.moving_variance)]
        with gan_standing.applied(values):
            sampled = task.sampler([z, labels], training=False).numpy()
        assert np.abs(sampled - copied).max() > 1e-4  # the standing statistics, not the copied ones
        return {"serving_default/image": sampled, "online/image": task.generator([z, labels], training=False).numpy()}

    assert_served(task, inputs, expected, tmp_path)
    np.testing.assert_array_equal(task.sampler([z, labels], training=False).numpy(), copied)  # the task's untouched


def _d4pg_task(**overrides):
    kwargs = dict(environment=functools.partial(control_suite, name="cartpole/balance"),
                  policy_network=functools.partial(d4pg_policy, layer_sizes=(16,)),
                  critic_network=functools.partial(d4pg_critic, layer_sizes=(16,), num_atoms=11, v_min=-20.0,
                                                   v_max=20.0), min_replay_size=8, eval_episodes=1)
    kwargs.update(overrides)
    rep = xf.Replicator("cpu", 1)
    task = D4PGTask(**kwargs)
    task.setup(rep, 8, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    return task


def _observations(task, count=4):
    """Observations the actor feeds the policy: from the environment's first steps."""
    env, out = task.eval_environment, [task.eval_environment.reset()]
    for _ in range(count - 1):
        out.append(env.step(RNG.uniform(-1, 1, env.action_size).astype(np.float32))[0])
    return np.stack(out)


@pytest.mark.parametrize("pixels", [False, True], ids=["states", "pixels"])
def test_d4pg_serves_the_noiseless_policy(pixels, tmp_path):
    encoder = functools.partial(drq_encoder, num_filters=4, num_layers=2, feature_size=8)
    task = _d4pg_task(**(dict(environment=functools.partial(control_suite, name="cartpole/swingup", pixels=True,
                                                            size=16, frame_stack=2), observation_network=encoder)
                         if pixels else {}))
    try:
        observations = _observations(task)
        assert observations.dtype == (np.uint8 if pixels else np.float32)
        features = task.observation_network(observations) if pixels else observations
        actions = task.policy(features, training=False).numpy()
        assert np.abs(actions).max() > 0
        assert_served(task, {"serving_default/observation": observations}, {"serving_default/action": actions},
                      tmp_path)
    finally:
        task.close()


# -- docs/extending.md's example ------------------------------------------------------------


def test_the_user_task_example_of_extending_md(tmp_path):
    """The page's block, as a module beside examples/regression's (on sys.path, as a gin file's folder is)."""
    with open(os.path.join(mr.ROOT, "docs", "extending.md"), encoding="utf-8") as f:
        block = re.search(r"<!-- run by: tests/test_export.py -->\n```python\n(.*?)```", f.read(), re.S).group(1)
    (tmp_path / "served_regression.py").write_text(block)
    sys.path[:0] = [str(tmp_path), os.path.join(mr.ROOT, "examples", "regression")]
    try:
        served = importlib.import_module("served_regression")
        mlp = importlib.import_module("mlp_model").mlp
    finally:
        del sys.path[:2]
    rep = xf.Replicator("cpu", 1)
    task = served.ServedRegressionTask(model=mlp, dataset=None, optimizer=keras.optimizers.Adam)
    task.setup(rep, 8, seed=0, deterministic=False)
    with rep.scope():
        task.build()
    x = RNG.normal(size=(7, 8)).astype(np.float32)
    y = task.model(x, training=False).numpy()[:, 0]
    assert_served(task, {"serving_default/x": x}, {"serving_default/y": y}, tmp_path)
