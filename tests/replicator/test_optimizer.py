"""wrap_optimizer: N-replica training equals 1-replica training on the same global batch."""

import os

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.replicator import keras_hooks
from expframe.replicator import optimizer as optimizer_lib
from expframe.replicator.replicator import mean_over_steps
from tests import support

GLOBAL_BATCH = 16


def _batches(steps, batch=GLOBAL_BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, 6, 6, 2)).astype(np.float32),
             rng.integers(0, 3, size=(batch,)).astype(np.int32)) for _ in range(steps)]


def _model(norm=True):
    keras.utils.set_random_seed(0)
    layers = {True: lambda: xf.layers.SyncBatchNorm(momentum=0.9),
              "plain": lambda: keras.layers.BatchNormalization(momentum=0.9),
              False: keras.layers.Identity}
    return keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3), layers[norm](),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])


def _loss(model, x, y, w):
    """Mean over the batch of w * cross-entropy (w: per-example weights, usually 1)."""
    logits = model(x, training=True)
    return tf.reduce_mean(w * keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def _with_weights(batches):
    return [b if len(b) == 3 else (b[0], b[1], np.ones(len(b[0]), np.float32)) for b in batches]


class PlainKeras:
    """The single-device reference: plain Keras, no strategy, no wrapper."""

    def __init__(self, make_opt=None, norm=True):
        self.model = _model(norm)  # SyncBatchNorm on one device is BatchNormalization
        self.opt = make_opt() if make_opt else keras.optimizers.SGD(0.1, momentum=0.9)

        @tf.function
        def step(x, y, w):
            with tf.GradientTape() as tape:
                loss = _loss(self.model, x, y, w)
            self.opt.apply_gradients(zip(tape.gradient(loss, self.model.trainable_variables),
                                         self.model.trainable_variables, strict=True))

        self._step = step

    def train(self, batches):
        for x, y, w in _with_weights(batches):
            self._step(x, y, w)
        return self

    def forward(self, x):
        """A training-mode forward pass only: batch norm's moving statistics move."""
        self.model(x, training=True)
        return self

    def weights(self):
        return [np.asarray(v) for v in self.model.weights]


class Trainer:
    """A minimal replicated training loop, the way a user writes one.

    entry: how the step is launched: "replicator" (Replicator.run), "strategy"
    (tf.distribute's strategy.run directly), or "loop" (all batches of one train()
    call in one tf.function, a tf.range loop over a distributed iterator).
    """

    def __init__(self, rep, accumulate_steps=1, clip=None, make_opt=None, loss_scale=None, norm=True,
                 entry="replicator", gradients="scale_loss"):
        self.rep, self.entry = rep, entry
        with rep.scope():
            self.model = _model(norm)
            base = make_opt() if make_opt else keras.optimizers.SGD(0.1, momentum=0.9)
            self.opt = xf.wrap_optimizer(base, accumulate_steps=accumulate_steps,
                                         clip_global_norm=clip, loss_scale=loss_scale)

        def step(x, y, w):
            variables = self.model.trainable_variables
            if gradients == "minimize_fn":  # the loss as a function: minimize records it
                return self.opt.minimize(lambda: _loss(self.model, x, y, w), variables)
            with tf.GradientTape() as tape:
                loss = _loss(self.model, x, y, w)
                scaled = self.opt.scale_loss(loss) if gradients != "forget" else None
            if gradients == "minimize":
                self.opt.minimize(loss, variables, tape)
                return loss
            # "forget": the D4PG mistake, gradients of the loss, never scaled; "unused":
            # scale_loss called, but the unscaled loss differentiated.
            grads = tape.gradient(scaled if gradients == "scale_loss" else loss, variables)
            self.opt.apply_gradients(zip(grads, variables, strict=True))
            return loss

        self._step_fn = step
        if entry == "strategy":
            self._step = tf.function(lambda x, y, w: rep.strategy.run(step, args=(x, y, w)))
        else:
            self._step = tf.function(lambda x, y, w: rep.run(step, x, y, w))
        self._loop = tf.function(lambda it, n: mean_over_steps(lambda: rep.reduce(rep.run(step, *next(it))), n))

    def train(self, batches):
        n = self.rep.num_replicas
        batches = _with_weights(batches)
        if self.entry == "loop":  # each global batch split over the replicas in order, as below
            data = tf.data.Dataset.from_tensor_slices(tuple(np.concatenate(a) for a in zip(*batches, strict=True)))
            it = iter(self.rep.strategy.experimental_distribute_dataset(data.batch(len(batches[0][0]))))
            self._loop(it, tf.constant(len(batches)))
            return
        for x, y, w in batches:
            b = len(x) // n
            self._step(*(support.per_replica(self.rep, lambda r, a=a, b=b: a[r * b:(r + 1) * b]) for a in (x, y, w)))

    def weights(self):
        for v in self.model.weights:
            values = self.rep.local_results(v.value)
            for other in values[1:]:
                np.testing.assert_array_equal(other, values[0], err_msg=f"{v.path} differs across replicas")
        return [np.asarray(self.rep.local_results(v.value)[0]) for v in self.model.weights]


class OptimizerTest(support.TestCase):

    def assertWeightsClose(self, a, b, atol=1e-5):
        self.assertEqual(len(a), len(b))
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5)

    @parameterized.named_parameters(*support.named_replicators())
    def test_replication_invariance(self, target, n):
        batches = _batches(10)
        reference = PlainKeras().train(batches)
        trainer = Trainer(support.replicator(target, n))
        trainer.train(batches)
        self.assertWeightsClose(trainer.weights(), reference.weights())
        self.assertEqual(int(trainer.opt.iterations.numpy()), 10)
        # The run actually moved the weights (not a vacuous equality).
        self.assertGreater(np.abs(trainer.weights()[0] - PlainKeras().weights()[0]).max(), 1e-3)

    @parameterized.named_parameters(*support.named_replicators(min_replicas=2))
    def test_adam_slots_built_in_scope_lazily(self, target, n):
        batches = _batches(3)
        def make():
            return keras.optimizers.Adam(1e-2)

        # No batch norm: the conv bias before it has a gradient of ~0, which Adam's
        # g / sqrt(v) turns from rounding noise into O(lr) steps.
        reference = PlainKeras(make_opt=make, norm=False).train(batches)
        trainer = Trainer(support.replicator(target, n), make_opt=make, norm=False)
        trainer.train(batches)
        self.assertWeightsClose(trainer.weights(), reference.weights())

    @parameterized.named_parameters(*support.named_replicators())
    def test_accumulation_equals_large_batch(self, target, n):
        big = _batches(3, batch=32)
        # No batch norm here: its statistics depend on the batch size by design.
        reference = PlainKeras(norm=False).train(big)
        trainer = Trainer(support.replicator(target, n), accumulate_steps=4, norm=False)
        micro = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for x, y in big for i in range(4)]
        trainer.train(micro[:6])
        self.assertEqual(int(trainer.opt.iterations.numpy()), 1)
        trainer.train(micro[6:])
        self.assertEqual(int(trainer.opt.iterations.numpy()), 3)
        self.assertWeightsClose(trainer.weights(), reference.weights())

    def test_clipping_happens_after_the_cross_replica_mean(self):
        batches = _batches(2)
        # Keras' own clipping by global norm on one device.
        reference = PlainKeras(make_opt=lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05))
        reference.train(batches)
        trainer = Trainer(support.replicator("cpu", 4), clip=0.05)
        trainer.train(batches)
        self.assertWeightsClose(trainer.weights(), reference.weights())
        unclipped = PlainKeras().train(batches)
        self.assertGreater(np.abs(unclipped.weights()[0] - reference.weights()[0]).max(), 1e-4)

    @parameterized.named_parameters(("four_to_one", 4, 1), ("four_to_two", 4, 2), ("one_to_four", 1, 4),
                                    ("two_to_four_accumulating", 2, 4, 2))
    def test_checkpoint_portable_across_replica_counts(self, before, after, accumulate=1):
        batches = _batches(8)
        straight = Trainer(support.replicator("cpu", 1), accumulate_steps=accumulate)
        straight.train(batches)
        first = Trainer(support.replicator("cpu", before), accumulate_steps=accumulate)
        first.train(batches[:3])  # with accumulation, stops mid-accumulation
        path = tf.train.Checkpoint(model=first.model, opt=first.opt).save(os.path.join(self.get_temp_dir(), "ckpt"))
        second = Trainer(support.replicator("cpu", after), accumulate_steps=accumulate)
        with second.rep.scope():  # slots must exist to be restored into
            second.opt.build(second.model.trainable_variables)
        tf.train.Checkpoint(model=second.model, opt=second.opt).restore(path).assert_consumed()
        second.train(batches[3:])
        self.assertWeightsClose(second.weights(), straight.weights())

    @parameterized.named_parameters(
        ("accumulate_replicator_run", 2, None, "replicator"), ("accumulate_strategy_run", 2, None, "strategy"),
        ("accumulate_in_a_loop", 2, None, "loop"), ("loss_scale_strategy_run", 1, "dynamic", "strategy"),
        ("loss_scale_in_a_loop", 1, "dynamic", "loop"))
    def test_conditional_update_whoever_launches_the_step(self, k, loss_scale, entry):
        """The update happens inside apply_gradients: exactly on every k-th micro-batch,
        through Replicator.run, strategy.run or a loop of steps in one tf.function."""
        big = _batches(3, batch=16 * k)
        reference = PlainKeras(norm=False).train(big)  # no batch norm: its statistics depend on the batch
        trainer = Trainer(support.replicator("cpu", 2), accumulate_steps=k, loss_scale=loss_scale, norm=False,
                          entry=entry)
        micro = [(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for x, y in big for i in range(k)]
        if entry == "loop":  # k micro-batches per tf.function call, i.e. one update per call
            for i in range(3):
                trainer.train(micro[i * k:(i + 1) * k])
                self.assertEqual(int(trainer.opt.iterations.numpy()), i + 1)
        else:
            for i, batch in enumerate(micro):
                trainer.train([batch])
                self.assertEqual(int(trainer.opt.iterations.numpy()), (i + 1) // k, f"after micro-batch {i + 1}")
        self.assertWeightsClose(trainer.weights(), reference.weights())

    def test_dynamic_loss_scale_skips_non_finite_updates(self):
        trainer = Trainer(support.replicator("cpu", 2), loss_scale="dynamic")
        self.assertEqual(float(trainer.opt.loss_scale.numpy()), 2.0 ** 15)
        x, y = _batches(1)[0]
        before = trainer.weights()
        poison = np.ones(len(x), np.float32)
        poison[0] = np.inf  # replica 0's loss and gradient: its forward pass itself is finite
        trainer.train([(x, y, poison)])
        # Nothing applied, the scale halved. Batch norm's moving statistics did see the
        # forward pass, as they do in plain Keras: every weight is checked against it.
        reference = PlainKeras().forward(x)
        self.assertWeightsClose(trainer.weights(), reference.weights(), atol=1e-6)
        for variable, old, new in zip(trainer.model.weights, before, trainer.weights(), strict=True):
            if variable.trainable:
                np.testing.assert_array_equal(new, old, err_msg=variable.path)
            else:  # the moving statistics moved: the comparison above is not vacuous
                self.assertGreater(np.abs(new - old).max(), 1e-3, variable.path)
        self.assertEqual(float(trainer.opt.loss_scale.numpy()), 2.0 ** 14)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 0)
        trainer.train([(x, y)])
        self.assertEqual(int(trainer.opt.iterations.numpy()), 1)
        reference.train([(x, y)])
        self.assertWeightsClose(trainer.weights(), reference.weights(), atol=1e-5)
        self.assertGreater(np.abs(trainer.weights()[0] - before[0]).max(), 1e-4)

    @parameterized.named_parameters(("minimize_dynamic_scale", "minimize", "dynamic"),
                                    ("minimize_a_loss_function_fixed_scale", "minimize_fn", 128.0))
    def test_minimize_is_the_whole_update(self, gradients, loss_scale):
        """One call scales, differentiates, unscales, averages and applies: 2 replicas
        with loss scaling take the updates of plain Keras on one device."""
        batches = _batches(3)
        reference = PlainKeras(norm=False).train(batches)
        trainer = Trainer(support.replicator("cpu", 2), loss_scale=loss_scale, norm=False, gradients=gradients)
        trainer.train(batches)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 3)
        self.assertWeightsClose(trainer.weights(), reference.weights())

    @parameterized.named_parameters(("forgotten_dynamic_scale", "dynamic", "replicator", "forget"),
                                    ("scaled_but_unused_fixed_scale_in_a_loop", 64.0, "loop", "unused"),
                                    ("forgotten_eagerly", "dynamic", "eager", "forget"))
    def test_gradients_of_an_unscaled_loss_are_refused(self, loss_scale, entry, gradients):
        """With loss scaling on, apply_gradients refuses gradients that did not come from
        scale_loss or minimize (they would be divided by the scale), naming the step.
        Traced, each gradient must descend from the scale; eagerly, scale_loss must
        have been called (an unused scaled loss is caught only when traced)."""
        trainer = Trainer(support.replicator("cpu", 2 if entry != "eager" else 1), loss_scale=loss_scale,
                          norm=False, gradients=gradients, entry="strategy" if entry == "eager" else entry)
        before = trainer.weights()
        x, y = _batches(1)[0]
        with self.assertRaises(xf.ConfigError) as caught:
            if entry == "eager":  # no tf.function: the step runs eagerly
                trainer.rep.strategy.run(trainer._step_fn, args=(x, y, np.ones(len(x), np.float32)))
            else:
                trainer.train([(x, y)])
        message = str(caught.exception)
        self.assertEqual(len(message.splitlines()), 1, message)
        self.assertRegex(message, r"^(Trainer\.)?step \(tests/replicator/test_optimizer.py(:\d+)?\) passed "
                                  r"gradients of an unscaled loss to apply_gradients .*loss scaling is on.*"
                                  r"`optimizer.minimize\(loss, variables, tape\)`.*`optimizer.scale_loss\(loss\)`")
        for old, new in zip(before, trainer.weights(), strict=True):
            np.testing.assert_array_equal(new, old)  # nothing applied
        self.assertEqual(int(trainer.opt.iterations.numpy()), 0)

    # -- the loss-scale check follows the program (issue 30) -------------------------

    def _scaled_trainer(self, step_of, replicas=2, loss_scale=64.0):
        """A Trainer whose step is `step_of(trainer)`; loss scaling on, no batch norm."""
        trainer = Trainer(support.replicator("cpu", replicas), loss_scale=loss_scale, norm=False)
        step = step_of(trainer)
        trainer._step = tf.function(lambda x, y, w: trainer.rep.run(step, x, y, w))
        return trainer

    def test_gradients_of_scale_loss_in_a_nested_tf_function_are_accepted(self):
        """The gradients come out of a nested tf.function (a call op in the step's graph);
        the old check looked only in the step's own graph and refused them (exit 2)."""
        def step_of(trainer):
            @tf.function
            def gradients(x, y, w):
                with tf.GradientTape() as tape:
                    scaled = trainer.opt.scale_loss(_loss(trainer.model, x, y, w))
                return tape.gradient(scaled, trainer.model.trainable_variables)

            def step(x, y, w):
                variables = trainer.model.trainable_variables
                trainer.opt.apply_gradients(zip(gradients(x, y, w), variables, strict=True))
            return step

        batches = _batches(2)
        trainer = self._scaled_trainer(step_of)
        trainer.train(batches)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 2)
        self.assertWeightsClose(trainer.weights(), PlainKeras(norm=False).train(batches).weights())

    def test_micro_batch_gradients_accumulated_in_a_tf_range_loop_are_accepted(self):
        """Each replica sums the gradients of 2 micro-batches of scale_loss in a tf.range
        loop (a while loop: its body is another graph), then applies their mean: the
        update of one batch. The old check refused it (exit 2, "unscaled loss")."""
        def step_of(trainer):
            def step(x, y, w):
                variables = trainer.model.trainable_variables
                half = tf.shape(x)[0] // 2
                total = [tf.zeros_like(v) for v in variables]
                for i in tf.range(2):
                    part = slice(i * half, (i + 1) * half)
                    with tf.GradientTape() as tape:
                        scaled = trainer.opt.scale_loss(_loss(trainer.model, x[part], y[part], w[part]))
                    total = [t + g for t, g in zip(total, tape.gradient(scaled, variables), strict=True)]
                trainer.opt.apply_gradients(zip([t / 2.0 for t in total], variables, strict=True))
            return step

        batches = _batches(2)
        trainer = self._scaled_trainer(step_of)
        trainer.train(batches)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 2)
        self.assertWeightsClose(trainer.weights(), PlainKeras(norm=False).train(batches).weights())

    def test_a_partly_scaled_loss_is_refused(self):
        """`scale_loss(ce) + l2`: the regulariser's gradient would be divided by the scale
        (its update 64 times too small). The old check accepted it: every gradient is a
        sum with one scaled term."""
        def step_of(trainer):
            def step(x, y, w):
                variables = trainer.model.trainable_variables
                with tf.GradientTape() as tape:
                    l2 = 1e-2 * tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
                    loss = trainer.opt.scale_loss(_loss(trainer.model, x, y, w)) + l2
                trainer.opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
            return step

        trainer = self._scaled_trainer(step_of)
        before = trainer.weights()
        with self.assertRaises(xf.ConfigError) as caught:
            trainer.train(_batches(1))
        message = str(caught.exception)
        self.assertEqual(len(message.splitlines()), 1, message)
        self.assertRegex(message, r"^step( \(tests/replicator/test_optimizer.py(:\d+)?\))? passed "
                                  r"gradients of a partly scaled loss to apply_gradients \(sequential.*/kernel, "
                                  r".*loss scale \(64\); scale the whole loss, `optimizer.scale_loss\(loss \+ "
                                  r"regulariser\)`, or use `optimizer.minimize\(loss, variables, tape\)`")
        for old, new in zip(before, trainer.weights(), strict=True):
            np.testing.assert_array_equal(new, old)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 0)

    def test_eagerly_the_tape_that_computes_the_gradients_must_go_through_the_scale(self):
        """Eagerly, scale_loss called only for a log line (outside the tape) let the
        unscaled gradients through; now the scale counts only when the gradients were
        computed through it. The right program still runs eagerly."""
        trainer = Trainer(support.replicator("cpu", 1), loss_scale=64.0, norm=False)
        variables = trainer.model.trainable_variables
        x, y = _batches(1)[0]
        w = np.ones(len(x), np.float32)
        logged = []

        def log_only():  # scale_loss for the log line, outside the tape; gradients of the loss
            with tf.GradientTape() as tape:
                loss = _loss(trainer.model, x, y, w)
            logged.append((float(trainer.opt.scale_loss(loss)), float(loss)))
            trainer.opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

        def scaled():  # the right program
            with tf.GradientTape() as tape:
                loss = trainer.opt.scale_loss(_loss(trainer.model, x, y, w))
            trainer.opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

        before = trainer.weights()
        with self.assertRaisesRegex(xf.ConfigError, r"passed gradients of an unscaled loss to apply_gradients"):
            trainer.rep.strategy.run(log_only)  # no tf.function: eagerly
        self.assertAlmostEqual(logged[0][0], 64.0 * logged[0][1], places=3)
        for old, new in zip(before, trainer.weights(), strict=True):
            np.testing.assert_array_equal(new, old)
        trainer.rep.strategy.run(scaled)
        self.assertEqual(int(trainer.opt.iterations.numpy()), 1)
        reference = PlainKeras(norm=False).train([(x, y)])
        self.assertWeightsClose(trainer.weights(), reference.weights())

    def test_plain_batch_norm_statistics_agree_across_replicas_after_training(self):
        trainer = Trainer(support.replicator("cpu", 4), norm="plain")
        trainer.train(_batches(3))
        weights = trainer.weights()  # asserts that every replica holds the same values
        stats = [w for w, v in zip(weights, trainer.model.weights, strict=True) if "moving" in v.path]
        self.assertLen(stats, 2)
        self.assertGreater(np.abs(stats[0]).max(), 1e-3)  # they moved

    def test_missing_keras_hook_fails_loudly(self):
        optimizer_lib.check_keras_hooks()  # the installed Keras has it
        owner = next(c for c in keras.optimizers.Optimizer.__mro__ if "_all_reduce_sum_gradients" in vars(c))
        hook = vars(owner)["_all_reduce_sum_gradients"]
        delattr(owner, "_all_reduce_sum_gradients")
        try:
            with self.assertRaisesRegex(keras_hooks.KerasHookError,
                                        r"wrap_optimizer overrides a private Keras hook, but .*Optimizer has no "
                                        r"method _all_reduce_sum_gradients.*sum.*supports Keras >=3.15,<3.16"):
                optimizer_lib.check_keras_hooks()
        finally:
            owner._all_reduce_sum_gradients = hook
        updater = vars(owner)["_backend_update_step"]
        owner._backend_update_step = lambda self, grads, variables, lr: None  # a renamed hook: not called
        try:
            with self.assertRaisesRegex(keras_hooks.KerasHookError, "no longer calls _all_reduce_sum_gradients"):
                optimizer_lib.check_keras_hooks()
        finally:
            owner._backend_update_step = updater
        optimizer_lib.check_keras_hooks()

    def test_bad_arguments(self):
        rep = support.replicator("cpu", 2)
        outside = keras.optimizers.SGD(0.1)
        with rep.scope():
            with self.assertRaisesRegex(xf.ConfigError, "created outside the Replicator's scope"):
                xf.wrap_optimizer(outside)
            for kwargs, pattern in ((dict(accumulate_steps=0), "accumulate_steps=0"),
                                    (dict(clip_global_norm=-1.0), "clip_global_norm=-1.0"),
                                    (dict(loss_scale="auto"), "loss_scale='auto'")):
                with self.assertRaisesRegex(xf.ConfigError, pattern):
                    xf.wrap_optimizer(keras.optimizers.SGD(0.1), **kwargs)
