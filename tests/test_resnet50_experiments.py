"""The ResNet-50 ImageNet experiments (experiments/resnet50_imagenet*.gin).

The fake-data variant runs through main.py on 2 CPU replicas; every variant must
parse and bind what it promises (the TPU, GPU and multi-worker ones cannot run
here); the real experiment without data is a one-line configuration error.
"""

import json
import os

import gin
import numpy as np
import pytest
import tensorflow as tf

from expframe import config
from tests import main_runner as mr

BASE = "experiments/resnet50_imagenet.gin"
FAKE = "experiments/resnet50_imagenet_fake.gin"
TARGETS = {  # gin file -> Replicator.target it must bind
    BASE: "auto",
    "experiments/resnet50_imagenet_tpu.gin": "tpu",
    "experiments/resnet50_imagenet_gpu.gin": "gpu",
    "experiments/resnet50_imagenet_multi_worker.gin": "multi_worker",
    FAKE: "cpu",
}
STEPS_PER_EPOCH = 1_281_167 // 1024
# ResNet-50 at 224x224 takes minutes per step on a shared 2-core CPU; 64x64 keeps the
# full model (depth 50, 1000 classes, the real JPEG pipeline) but 12x fewer FLOPs.
SMALL = ("Trainer.global_batch_size = 4", "Trainer.train_steps = 2", "Trainer.steps_per_loop = 1",
         "Trainer.log_every_steps = 1", "Trainer.eval_steps = 1", "imagenet_input.mock_num_examples = 8",
         "imagenet_input.image_size = 64", "resnet.input_shape = (64, 64, 3)")


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _parse(path):
    """Parses one gin file; returns a query that resolves macros (%GLOBAL_BATCH)."""
    config.parse([path], [])

    def query(binding):
        value = gin.query_parameter(binding)
        if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
            return value.scoped_configurable_fn()
        return value
    return query


def _trainable(reader):
    names = [n for n in reader.get_variable_to_shape_map() if n.startswith("model/")
             and not any(stat in n for stat in ("moving_mean", "moving_variance"))]
    return {n: reader.get_tensor(n) for n in names}


# Slow (about 160 s): for the default suite's time limit.
@pytest.mark.slow
def test_fake_experiment_trains_and_evaluates_on_two_cpu_replicas(tmp_path):
    model_dir = tmp_path / "run"
    done = mr.run([FAKE], model_dir, tmp_path / "tfds", SMALL + ("Trainer.checkpoint_every_steps = 1",), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((model_dir / "result.json").read_text())
    assert (result["step"], result["target"], result["num_replicas"], result["global_batch_size"]) == (2, "cpu", 2, 4)
    assert 0.0 <= result["eval"]["top1"] <= result["eval"]["top5"] <= 1.0
    train = mr.metrics(model_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in train)
    operative = (model_dir / "operative_config.gin").read_text()
    assert "resnet.depth = 50" in operative and "resnet.num_classes = 1000" in operative
    assert "imagenet_input.use_mock = True" in operative and "Trainer.global_batch_size = 4" in operative
    # The weights moved. The warm-up starts at lr 0, so step 1 leaves them as initialised
    # and step 2 (lr > 0) must change them: compare the checkpoints of steps 1 and 2.
    checkpoints = model_dir / "checkpoints"
    first, last = (tf.train.load_checkpoint(str(checkpoints / f"ckpt-{s}")) for s in (1, 2))
    iterations = [n for n in last.get_variable_to_shape_map() if n.startswith("optimizer/") and "iterations/" in n]
    assert iterations and int(last.get_tensor(sorted(iterations)[0])) == 2, iterations
    before, after = _trainable(first), _trainable(last)
    assert before.keys() == after.keys() and len(before) == 161, len(before)  # ResNet-50's weights
    assert all(np.all(np.isfinite(w)) for w in after.values())
    moved = {n for n in before if np.any(before[n] != after[n])}
    # What a gradient reaches at the first update must move: the logits (kernel, bias),
    # the 7x7 stem conv, and the 16 zero-initialised gammas (zero_init_residual) that
    # close each residual branch (the rest of a branch waits for its gamma to leave 0).
    logits = {n for n in before if "bias" in n}
    logits |= {n.replace("bias", "_kernel") for n in logits}
    stem = {n for n in before if before[n].shape[:2] == (7, 7)}
    zero_gammas = {n for n in before if "gamma" in n and not before[n].any()}
    assert len(logits) == 2 and len(stem) == 1 and len(zero_gammas) == 16
    assert logits | stem | zero_gammas <= moved, sorted((logits | stem | zero_gammas) - moved)

@pytest.mark.parametrize("path", sorted(TARGETS))
def test_every_variant_parses_and_binds_resnet50(path):
    query = _parse(path)
    assert query("resnet.depth") == 50
    assert query("resnet.num_classes") == 1000
    assert query("Replicator.target") == TARGETS[path]
    assert query("ClassificationTask.train_split") == "train"
    assert query("ClassificationTask.eval_split") == "validation"
    assert query("keras.optimizers.SGD.nesterov") is True
    assert query("keras.optimizers.SGD.momentum") == 0.9
    assert query("ClassificationTask.weight_decay") == 1e-4
    assert query("ClassificationTask.label_smoothing") == 0.1
    if path != FAKE:
        assert query("Trainer.global_batch_size") == 1024
        assert query("Trainer.train_steps") == 90 * STEPS_PER_EPOCH == 112_590
        assert query("imagenet_input.image_size") == 224


def test_variant_specific_bindings():
    assert _parse("experiments/resnet50_imagenet_gpu.gin")("Replicator.num_replicas") == 8
    assert _parse("experiments/resnet50_imagenet_tpu.gin")("run_experiment.precision") == "auto"
    query = _parse(FAKE)
    assert query("imagenet_input.use_mock") is True
    assert query("Replicator.num_replicas") == 2


def test_schedule_is_goyal_et_al_at_batch_1024():
    config.parse([BASE], [])
    from expframe.schedules import WarmupSchedule, training_run  # pylint: disable=import-outside-toplevel
    # In a run, the task builds the schedule with the trainer's batch and the train split's size.
    with training_run(gin.query_parameter("Trainer.global_batch_size"), 1_281_167):
        schedule = WarmupSchedule()
    assert schedule.global_batch_size == 1024
    assert schedule.steps_per_epoch == STEPS_PER_EPOCH
    lr = lambda epoch: float(schedule(int(epoch * STEPS_PER_EPOCH)))  # noqa: E731
    np.testing.assert_allclose([lr(0), lr(2.5), lr(5), lr(29.99), lr(30), lr(60), lr(80), lr(89.99)],
                               [0.0, 0.2, 0.4, 0.4, 0.04, 0.004, 0.0004, 0.0004], rtol=1e-3, atol=1e-7)


def test_real_experiment_without_data_is_a_config_error(tmp_path):
    data_dir, model_dir = tmp_path / "tfds", tmp_path / "run"
    manual = data_dir / "manual"
    done = mr.run([BASE], model_dir, data_dir,
                  (f"imagenet_input.data_dir = '{data_dir}'", f"imagenet_input.manual_dir = '{manual}'"),
                  timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert str(manual) in errors[0] and "ILSVRC2012_img_train.tar" in errors[0]
    assert not os.path.exists(model_dir)
