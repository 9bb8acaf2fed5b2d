"""Evaluation covers the eval split exactly: every example once, at any replica count,
with a batch that does not divide the split (the trainer pads and masks the last
batches), and a new evaluation reuses the traced eval step."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.data import masked
from expframe.tasks.classification import ClassificationTask
from expframe.trainer import Trainer
from tests import support

NUM_EVAL, CLASSES, FEATURES = 37, 7, 5


def _arrays(split):
    rng = np.random.default_rng(1 if split == "test" else 2)
    n = NUM_EVAL if split == "test" else 64
    return rng.standard_normal((n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n).astype(np.int32)


def _dataset(split, ctx, batch_size, training, seed, deterministic):
    del seed, deterministic
    images, labels = _arrays(split)
    ds = tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})
    ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.repeat().batch(batch_size, drop_remainder=True) if training else ds.batch(batch_size)


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])


def _expected(model):
    images, labels = _arrays("test")
    logits = model(images).numpy().astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ranks = (logits > logits[np.arange(len(labels)), labels][:, None]).sum(1)
    return {"loss": -log_probs[np.arange(len(labels)), labels].mean(), "top1": (ranks < 1).mean(),
            "top5": (ranks < 5).mean()}


class ExactEvalTest(support.TestCase):

    def _trainer(self, n, eval_steps=None, global_batch=8, task_cls=ClassificationTask):
        task = task_cls(model=_model, dataset=_dataset, optimizer=lambda: keras.optimizers.SGD(0.1))
        trainer = Trainer(train_steps=1, global_batch_size=global_batch, eval_steps=eval_steps)
        trainer.prepare(xf.Replicator("cpu", n), task, seed=0, deterministic=True)
        return trainer, task

    @parameterized.named_parameters(*support.named_replicators())
    def test_full_pass_counts_every_example_once(self, target, n):
        del target
        trainer, task = self._trainer(n)  # 37 examples, global batch 8: 4 full + 5 padded
        metrics = trainer.evaluator.evaluate_by_steps()
        want = _expected(task.model)
        for key in ("loss", "top1", "top5"):
            self.assertAllClose(metrics[key], want[key], rtol=1e-5, msg=key)
        # Without the padding the last 5 examples (37 - 4 x 8) would be dropped.
        self.assertEqual(set(metrics), {"loss", "top1", "top5"})

    def test_second_evaluation_reuses_the_traced_step(self):
        trainer, _ = self._trainer(2)
        first = trainer.evaluator.evaluate_by_steps()
        traces = trainer.evaluator._eval_step.experimental_get_tracing_count()  # pylint: disable=protected-access
        self.assertEqual(trainer.evaluator.evaluate_by_steps(), first)
        self.assertEqual(trainer.evaluator._eval_step.experimental_get_tracing_count(), traces)  # pylint: disable=protected-access

    def test_eval_steps_cycles_full_batches(self):
        trainer, task = self._trainer(2, eval_steps=10, global_batch=4)
        metrics = trainer.evaluator.evaluate_by_steps()  # 40 examples: the 37, then the first 3 again
        images, labels = _arrays("test")
        idx = np.arange(40) % NUM_EVAL
        logits = task.model(images[idx]).numpy()
        self.assertAllClose(metrics["top1"], np.mean(logits.argmax(1) == labels[idx]), rtol=1e-6)

    def test_a_task_that_ignores_the_mask_is_a_clear_error(self):
        class Unmasked(ClassificationTask):
            def eval_step(self, batch):
                return super().eval_step({k: v for k, v in batch.items() if k != "mask"})

        trainer, _ = self._trainer(2, task_cls=Unmasked)
        with self.assertRaisesRegex(xf.RunError, r"count=40.0 for 37 real examples.*batch\['mask'\]"):
            trainer.evaluator.evaluate_by_steps()


class MaskedBatchesTest(tf.test.TestCase):

    def test_pads_with_zero_mask_then_repeats_padding(self):
        ds = tf.data.Dataset.from_tensor_slices({"x": np.arange(5, dtype=np.int64)}).batch(2)
        out = list(masked.masked_batches(ds, 3, full_pass=True).take(3).as_numpy_iterator())
        self.assertAllEqual([b["x"].tolist() for b in out], [[0, 1, 2], [3, 4, 0], [0, 0, 0]])
        self.assertAllEqual([b["mask"].tolist() for b in out], [[1, 1, 1], [1, 1, 0], [0, 0, 0]])

    def test_refuses_non_dict_elements(self):
        with self.assertRaisesRegex(TypeError, "batches of dicts"):
            masked.masked_batches(tf.data.Dataset.range(4).batch(2), 2, full_pass=True)
