"""KerasModelTask: a compiled Keras model trained and evaluated by expframe's loop.

Here, on a tiny model and in-memory data, over the named replicator settings: a train
step's loss is the compiled loss of the global batch plus `model.losses` (Keras' own
division by the replicas multiplied back out), its metrics are the compiled ones, and
an exact evaluation with a partial last batch equals `model.evaluate`. Elsewhere: the
first 20 losses equal `fit`'s on 1 and 2 replicas (tests/test_porting.py, the guide's
Keras port: SGD with momentum, the same data order), and the task trains on every CPU
target, 2 loopback workers (`multi_worker`, through `python -m expframe.launch`) and
parameter servers included, taking the 1-replica updates (tests/conformance/: the
`keras` family, experiments/keras_shapes.gin).
"""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from expframe.errors import ConfigError
from expframe.tasks.keras_model import KerasModelTask
from expframe.trainer import Trainer
from tests import support

FEATURES, CLASSES, GLOBAL_BATCH = 6, 4, 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(64 + 37, FEATURES)).astype(np.float32)
Y = RNG.integers(0, CLASSES, size=64 + 37)


def tuples(split, ctx, batch_size, training, seed=0, deterministic=False):
    """Keras' (x, y) batches: 64 train examples (endless, in order), 37 test (a partial last batch)."""
    del seed, deterministic
    x, y = (X[:64], Y[:64]) if split == "train" else (X[64:], Y[64:])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.repeat().batch(batch_size, drop_remainder=True) if training else ds.batch(batch_size)


def dicts(split, ctx, batch_size, training, seed=0, deterministic=False):
    return tuples(split, ctx, batch_size, training, seed, deterministic).map(lambda x, y: {"features": x, "y": y})


def model(compiled=True, metrics=("accuracy",)):
    keras.utils.set_random_seed(1)
    built = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(CLASSES, kernel_regularizer=keras.regularizers.L2(0.01))])
    if compiled:
        built.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics))
    return built


def full_metrics():
    return model(metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
                          keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")])


class MeanOfMeans(keras.metrics.Metric):
    """A metric whose state is not a sum over examples."""

    def __init__(self, name="mean_of_means"):
        super().__init__(name=name)
        self.value = self.add_variable((), "zeros", aggregation="mean", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(tf.reduce_mean(tf.cast(y_pred, tf.float32)))

    def result(self):
        return self.value


class KerasModelTaskTest(support.TestCase):

    def _prepared(self, target, replicas, builder=full_metrics, dataset=tuples, **task_args):
        task = KerasModelTask(model=builder, dataset=dataset, **task_args)
        trainer = Trainer(train_steps=4, global_batch_size=GLOBAL_BATCH, steps_per_loop=1, log_every_steps=1)
        trainer.prepare(support.replicator(target, replicas), task, seed=0, deterministic=True)
        return trainer, task

    @parameterized.named_parameters(*support.named_replicators())
    def test_steps_take_the_compiled_loss_and_evaluation_equals_model_evaluate(self, target, replicas):
        trainer, task = self._prepared(target, replicas)
        reference = full_metrics()  # the same initial weights, on one device
        x, y = X[:GLOBAL_BATCH], Y[:GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = reference.compute_loss(x, y, reference(x, training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        regularization = float(tf.add_n(reference.losses))
        reference.compute_metrics(x, y, reference(x, training=True))
        metrics = trainer.run_train_steps(1)
        self.assertGreater(regularization, 1e-3)
        self.assertAllClose(metrics["loss"], float(loss), atol=1e-6)  # not divided by the replicas
        self.assertAllClose(metrics["reg_loss"], regularization, atol=1e-7)
        self.assertAllClose(metrics["accuracy"], float(reference.metrics[1].result()["accuracy"]), atol=1e-6)
        self.assertEqual(sorted(metrics), ["accuracy", "loss", "reg_loss", "top2", "xent"])
        # One update of SGD(0.1) on the global batch's mean gradient, as one device takes it.
        for variable, grad, trained in zip(reference.trainable_variables, grads, task.model.trainable_variables,
                                           strict=True):
            self.assertAllClose(np.asarray(trained.numpy()), variable.numpy() - 0.1 * grad.numpy(), atol=1e-6)

        trainer.run_train_steps(1)
        evaluated = trainer.evaluator.evaluate(2)  # 37 examples: the last batches padded
        reference.set_weights(task.model.get_weights())
        expected = reference.evaluate(X[64:], Y[64:], batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
        self.assertEqual(sorted(evaluated), sorted(expected))
        for name, value in expected.items():
            self.assertAllClose(evaluated[name], value, atol=1e-6, msg=name)

    def test_dict_batches_name_their_keys(self):
        trainer, _ = self._prepared("cpu", 1, dataset=dicts, features="features", labels="y")
        self.assertIn("loss", trainer.run_train_steps(1))
        with self.assertRaisesRegex(ConfigError, r"^KerasModelTask.features='image': the dataset's batches have "
                                                 r"no 'image' \(their keys: \['features', 'y'\]\)"):
            self._prepared("cpu", 1, dataset=dicts)

    def test_an_uncompiled_model_is_refused(self):
        with self.assertRaisesRegex(ConfigError, r"^KerasModelTask.model=<lambda> returned a model that is not "
                                                 r"compiled for training \(compile\(\) was not called\)"):
            self._prepared("cpu", 1, builder=lambda: model(compiled=False))

    def test_a_metric_that_is_not_a_sum_is_refused(self):
        with self.assertRaisesRegex(ConfigError, r"the compiled metric 'mean_of_means' keeps 'value' with "
                                                 r"aggregation='mean', not a sum over examples"):
            self._prepared("cpu", 1, builder=lambda: model(metrics=[MeanOfMeans()]))

    def test_serving_gives_the_models_outputs(self):
        _, task = self._prepared("cpu", 2)
        serve = task.serving()["serving_default"]
        self.assertAllClose(serve(tf.constant(X[:5]))["output"], task.model(X[:5], training=False), atol=1e-6)
