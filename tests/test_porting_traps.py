"""The porting traps of issue 51, each with the code pattern of TensorFlow's tutorial
"Custom training with tf.distribute.Strategy":

    per_example_loss = loss_object(labels, predictions)
    loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
    if model.losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))

1. A loss already divided across replicas is refused while the step is traced (one
   line naming the fix; through main.py: exit 2, nothing written), at any replica
   count, unless `wrap_optimizer.allow_divided_loss`; correct steps are not.
2. A model's `model.losses` are added by the shipped Keras-model tasks (classification,
   GAN, D4PG), once per step at any replica count, and shown as their own terms; a
   user step that never reads them is refused unless
   `wrap_optimizer.allow_unread_model_losses`.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import expframe as xf
from expframe.errors import ConfigError
from expframe.models import sngan
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from expframe.tasks.classification import ClassificationTask
from expframe.trainer import progress_line
from tests import main_runner as mr
from tests import support
from tests.tasks import test_d4pg, test_gan

GLOBAL_BATCH_SIZE = 8
L2, DECAY, LR = 1e-2, 1e-3, 0.1
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(64, 6)).astype(np.float32)
Y = (np.arange(64) % 3).astype(np.int32)


def input_fn(ctx):
    """Reads `ctx.num_replicas_in_sync` as an input function may (an InputContext: not a trap)."""
    per_replica = GLOBAL_BATCH_SIZE // ctx.num_replicas_in_sync
    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(per_replica, drop_remainder=True)


def regularized_model(kernel=True, activity=False):
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="tanh", kernel_regularizer=keras.regularizers.L2(L2) if kernel else None,
                           activity_regularizer=keras.regularizers.L2(L2) if activity else None),
        keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(L2) if kernel else None),
    ])


class Setup:
    """A model with L2 kernel regularizers and a wrapped SGD on `n` CPU replicas."""

    def __init__(self, n, model_fn=regularized_model, **wrap):
        keras.utils.set_random_seed(0)
        self.rep = support.replicator("cpu", n)
        with self.rep.scope():
            self.model = model_fn()
            self.other = regularized_model()  # called in some steps, updated by no optimizer
            self.optimizer = xf.wrap_optimizer(keras.optimizers.SGD(LR), **wrap)
        self.iterator = iter(self.rep.distribute(input_fn, GLOBAL_BATCH_SIZE))

    def step(self, loss_fn):
        """A step: loss_fn(labels, predictions) under the tape, then the tutorial's update."""
        model, optimizer = self.model, self.optimizer

        def train_step(inputs):
            images, labels = inputs
            with tf.GradientTape() as tape:
                predictions = model(images, training=True)
                loss = loss_fn(labels, predictions)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
            return {"loss": loss}
        return train_step

    def refusal(self, loss_fn):
        """The one line of the ConfigError that tracing the step raises, or None."""
        try:
            self.rep.trace_steps(self.step(loss_fn), self.iterator)
        except ConfigError as e:
            assert "\n" not in str(e), str(e)
            return str(e)
        return None


loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def tutorial_loss(model, global_batch_size=True):
    """The tutorial's `compute_loss`, as written (the newer tutorial drops global_batch_size)."""
    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        if global_batch_size:
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
        else:
            loss = tf.nn.compute_average_loss(per_example_loss)
        if model.losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        return loss
    return compute_loss


def correct_loss(model):
    return lambda labels, predictions: tf.reduce_mean(loss_object(labels, predictions)) + tf.add_n(model.losses)


def by_hand(weights, x, y, decay=0.0):
    """One device, the global batch: (cross-entropy, L2 regularisers, weight decay) and the
    SGD update of `weights` [kernel, bias, kernel, bias] on their sum."""
    w = [tf.Variable(v) for v in weights]
    with tf.GradientTape() as tape:
        logits = tf.tanh(x @ w[0] + w[1]) @ w[2] + w[3]
        ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        reg = L2 * (tf.reduce_sum(w[0] ** 2) + tf.reduce_sum(w[2] ** 2))
        wd = decay * (tf.nn.l2_loss(w[0]) + tf.nn.l2_loss(w[2]))
        total = ce + reg + wd
    grads = tape.gradient(total, w)
    return float(ce), float(reg), float(wd), [np.asarray(v - LR * g) for v, g in zip(w, grads, strict=True)]


class DividedLossTest(support.TestCase):

    def test_the_tutorials_loss_is_refused_at_any_replica_count(self):
        for n in (1, 2):
            setup = Setup(n)
            for with_batch in (True, False):
                with self.subTest(replicas=n, global_batch_size=with_batch):
                    error = setup.refusal(tutorial_loss(setup.model, with_batch))
                    self.assertIsNotNone(error)
                    self.assertRegex(error, r"^train_step divides its loss across replicas \(calls "
                                            r"tf\.nn\.compute_average_loss and calls tf\.nn\.scale_regularization_"
                                            r"loss in compute_loss \(.*tests/test_porting_traps\.py\)\), but ")
                    self.assertIn("write the loss as tf.reduce_mean(per_example_loss)", error)
                    self.assertIn("plus tf.add_n(model.losses) unscaled", error)
                    self.assertIn("bind wrap_optimizer.allow_divided_loss = True", error)

    def test_every_division_by_the_replicas_that_tracing_sees_is_refused(self):
        setup = Setup(2)
        strategy, model = setup.rep.strategy, setup.model
        mean = correct_loss(model)
        dividing = {
            "reads num_replicas_in_sync": lambda y, p: mean(y, p) / tf.distribute.get_replica_context(
                ).num_replicas_in_sync,
            "reads num_replicas_in_sync ": lambda y, p: mean(y, p) / strategy.num_replicas_in_sync,
            "calls tf.nn.scale_regularization_loss": lambda y, p: tf.reduce_mean(
                loss_object(y, p)) + tf.nn.scale_regularization_loss(tf.add_n(model.losses)),
            "calls a Keras loss object with reduction 'sum_over_batch_size'": lambda y, p: keras.losses.
            SparseCategoricalCrossentropy(from_logits=True)(y, p) + tf.add_n(model.losses),
        }
        for what, loss_fn in dividing.items():
            with self.subTest(what):
                error = setup.refusal(loss_fn)
                self.assertIsNotNone(error)
                self.assertIn(f"divides its loss across replicas ({what.strip()}", error)

    def test_correct_steps_are_not_refused(self):
        setup = Setup(2)
        model = setup.model

        for name, loss_fn in (("mean plus model.losses", correct_loss(model)),
                              ("xf.num_replicas() read", lambda y, p: correct_loss(model)(y, p)
                               + 0.0 * tf.cast(xf.num_replicas(), tf.float32))):
            with self.subTest(name):
                self.assertIsNone(setup.refusal(loss_fn))

    def test_the_opt_out_runs_the_division_as_written(self):
        """wrap_optimizer.allow_divided_loss: the tutorial's loss traces and runs, and is half
        the loss of the global batch at 2 replicas (the trap, measured)."""
        setup = Setup(2, allow_divided_loss=True)
        weights = setup.model.get_weights()
        step = setup.step(tutorial_loss(setup.model))
        logged = setup.rep.run_steps(step, setup.iterator, 1)["loss"]
        ce, reg, _, _ = by_hand(weights, X[:GLOBAL_BATCH_SIZE], Y[:GLOBAL_BATCH_SIZE])
        np.testing.assert_allclose(logged, (ce + reg) / 2, rtol=1e-5)


class ModelLossesTest(support.TestCase):

    def test_a_step_that_never_reads_model_losses_is_refused(self):
        setup = Setup(2)
        error = setup.refusal(lambda y, p: tf.reduce_mean(loss_object(y, p)))
        self.assertIsNotNone(error)
        self.assertRegex(error, r"^train_step never reads the model's regularisation "
                                r"losses \(the regularizer of sequential(_\d+)?/dense(_\d+)?/kernel and the "
                                r"regularizer of sequential(_\d+)?/dense(_\d+)?/kernel: model\.losses\), so they "
                                r"would not be trained; ")
        self.assertIn("loss = tf.reduce_mean(per_example_loss) + tf.add_n(model.losses)", error)
        self.assertIn("bind wrap_optimizer.allow_unread_model_losses = True", error)
        # Another model's losses, read, do not stand for this one's; that model, called
        # but updated by no optimizer here, needs no read.
        other = setup.other
        error = setup.refusal(lambda y, p: tf.reduce_mean(loss_object(y, p)) + 0.0 * tf.reduce_sum(
            other(tf.tile(p[:, :1], [1, 6]))) + tf.add_n(other.losses))
        self.assertIsNotNone(error)
        self.assertIsNone(setup.refusal(lambda y, p: correct_loss(setup.model)(y, p) + 0.0 * tf.reduce_sum(
            other(tf.tile(p[:, :1], [1, 6])))))
        self.assertIsNone(Setup(1, allow_unread_model_losses=True).refusal(
            lambda y, p: tf.reduce_mean(loss_object(y, p))))

    def test_an_activity_regularizer_counts_too(self):
        setup = Setup(1, model_fn=functools.partial(regularized_model, kernel=False, activity=True))
        error = setup.refusal(lambda y, p: tf.reduce_mean(loss_object(y, p)))
        self.assertIsNotNone(error)
        self.assertIn("never reads the model's regularisation losses (the add_loss of layer 'dense", error)
        self.assertIsNone(setup.refusal(correct_loss(setup.model)))


def classification_data(split, ctx, batch_size, training, seed=0, deterministic=False):
    """The dataset contract on (X, Y): images of 1 x 6 x 1 pixels, in order."""
    del split, seed, deterministic
    ds = tf.data.Dataset.from_tensor_slices({"image": X.reshape(-1, 1, 6, 1), "label": Y})
    ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.repeat().batch(batch_size, drop_remainder=True) if training else ds.batch(batch_size)


def image_model():
    model = regularized_model()
    return keras.Sequential([keras.Input((1, 6, 1)), keras.layers.Reshape((6,)), *model.layers])


def regularized(factory, **kwargs):
    """factory(**kwargs) with an L2 regularizer on every kernel (rank >= 2)."""
    model = factory(**kwargs)
    for v in model.trainable_variables:
        if len(v.shape) >= 2:
            v.regularizer = keras.regularizers.L2(L2)
    return model


def reg_of(model) -> float:
    return sum(L2 * float(np.sum(np.square(v))) for v in model.trainable_variables if len(v.shape) >= 2)


class ShippedTasksTest(support.TestCase):

    def _classification(self, n, weights=None):
        keras.utils.set_random_seed(0)
        rep = support.replicator("cpu", n)
        task = ClassificationTask(model=image_model, dataset=classification_data,
                                  optimizer=lambda: keras.optimizers.SGD(LR), weight_decay=DECAY)
        task.setup(rep, GLOBAL_BATCH_SIZE, seed=0, deterministic=False)
        with rep.scope():
            task.build()
        if weights is not None:
            task.model.set_weights(weights)
        before = task.model.get_weights()
        metrics = rep.run_steps(task.train_step, iter(rep.distribute(task.train_input_fn, GLOBAL_BATCH_SIZE)), 1)
        return before, metrics, task.model.get_weights()

    def test_classification_adds_model_losses_once_per_step_beside_weight_decay(self):
        weights, one, after_one = self._classification(1)
        _, two, after_two = self._classification(2, weights)
        ce, reg, wd, after = by_hand(weights, X[:GLOBAL_BATCH_SIZE], Y[:GLOBAL_BATCH_SIZE], decay=DECAY)
        self.assertGreater(reg, 0.01)  # large enough to matter at rtol 1e-5
        for metrics, trained in ((one, after_one), (two, after_two)):
            np.testing.assert_allclose([metrics[k] for k in ("cross_entropy", "reg_loss", "weight_decay_loss", "loss")],
                                       [ce, reg, wd, ce + reg + wd], rtol=1e-5)
            for got, want in zip(trained, after, strict=True):
                np.testing.assert_allclose(got, want, atol=1e-6)
        line = progress_line(1, 10, two, 100.0, 1.0)
        self.assertIn(f"  loss {ce + reg + wd:.4f}  cross_entropy {ce:.4f}  reg_loss {reg:.4f}  "
                      f"weight_decay_loss {wd:.4g}  accuracy", line)

    @pytest.mark.slow  # about 20 s on 2 cores (tracing SN-GAN's two networks): python -m pytest -m slow -k gan_adds
    def test_gan_adds_its_networks_losses(self):
        rep = support.replicator("cpu", 1)
        keras.utils.set_random_seed(0)
        gan = test_gan.make_task(
            generator=functools.partial(regularized, sngan.sngan_generator, ch=2, z_dim=test_gan.Z,
                                        widths=(2, 2, 1, 1)),
            discriminator=functools.partial(regularized, sngan.sngan_discriminator, ch=1), disc_steps=1,
            ema_decay=None, feature_network=None)
        gan.setup(rep, test_gan.GLOBAL_BATCH, seed=0, deterministic=False)
        with rep.scope():
            gan.build()
        d_reg, g_reg = reg_of(gan.discriminator), reg_of(gan.generator)
        iterator = rep.distribute(gan.train_input_fn, test_gan.GLOBAL_BATCH).plain_iterator()
        out = tf.function(lambda it: rep.reduce(rep.run(gan.train_step, rep.next_from(it)), "mean"))(iterator)
        out = {k: float(v) for k, v in out.items()}
        np.testing.assert_allclose([out["d_reg_loss"], out["g_reg_loss"]], [d_reg, g_reg], rtol=1e-5)
        np.testing.assert_allclose(out["loss"], out["d_loss"] + out["g_loss"] + d_reg + g_reg, rtol=1e-5)

    def test_d4pg_adds_its_networks_losses(self):
        learner = test_d4pg._Learner(  # pylint: disable=protected-access
            1, policy_network=functools.partial(regularized, d4pg_policy, layer_sizes=(32, 16)),
            critic_network=functools.partial(regularized, d4pg_critic, layer_sizes=(32, 16), num_atoms=11,
                                             v_min=-20.0, v_max=20.0))
        policy_reg, critic_reg = reg_of(learner.task.policy), reg_of(learner.task.critic)
        out = learner.host_call(1)
        np.testing.assert_allclose([out["actor_reg_loss"], out["critic_reg_loss"]], [policy_reg, critic_reg],
                                   rtol=1e-5)
        np.testing.assert_allclose(out["loss"], out["critic_loss"] + critic_reg, rtol=1e-5)


GIN = """
import tests.conformance.tutorial_task
include 'experiments/quickstart.gin'
run_experiment.task = @TutorialTask()
TutorialTask.model = @tutorial_model
TutorialTask.dataset = @shapes_input
TutorialTask.optimizer = @keras.optimizers.SGD
"""


def test_the_tutorials_step_is_refused_through_main(data_dir, tmp_path):
    gin_file = tmp_path / "tutorial.gin"
    gin_file.write_text(GIN)
    model_dir = tmp_path / "run"
    done = mr.run([str(gin_file)], model_dir, data_dir, mr.SMALL, extra=["--mode=train"])
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith(
        "error: TutorialTask.train_step (tests/conformance/tutorial_task.py) divides its loss across replicas "
        "(calls tf.nn.compute_average_loss and calls tf.nn.scale_regularization_loss in TutorialTask.train_step "
        "(tests/conformance/tutorial_task.py)), but wrap_optimizer already averages the gradients"), errors[0]
    assert "wrap_optimizer.allow_divided_loss = True" in errors[0]
    assert not model_dir.exists()  # refused while tracing, before anything was written
