"""The mesh target: training on meshes 1x1, 2x2, 1x4 and 4x1 gives the same weights;
slots are split like their variables; checkpoints move between mesh shapes."""

import os

import gin
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.errors import ConfigError
from expframe.models.vit import ViT
from expframe.replicator import mesh
from expframe.replicator.mesh_optimizer import MeshAdam
from tests.support import TestCase

_RNG = np.random.RandomState(0)
IMAGES = _RNG.rand(10, 8, 8, 8, 3).astype(np.float32)  # 10 steps of batch 8
LABELS = _RNG.randint(0, 4, size=(10, 8)).astype(np.int32)


class Run:
    """A tiny ViT and MeshAdam on a mesh Replicator, trained by Replicator.run."""

    def __init__(self, batch: int, model: int, drop_reduction: bool = False, stem_widths=()):
        self.rep = xf.Replicator(target="mesh", mesh_shape={"batch": batch, "model": model})
        with self.rep.scope():
            self.model = ViT(num_classes=4, image_size=8, patch_size=4, width=16, depth=1, num_heads=4,
                             mlp_dim=32, seed=3, stem_widths=stem_widths)
            self.opt = MeshAdam(learning_rate=0.01)
            self.opt.build(self.model.trainable_variables)
        self.drop_reduction = drop_reduction
        self.step = tf.function(self._step)

    def _step(self, images, labels):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            logits = self.model(images)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        grads = tape.gradient(loss, variables)
        self.opt.apply(grads, variables)
        return {"loss": loss}

    def train(self, first: int, last: int) -> list:
        losses = []
        for i in range(first, last):
            out = self.rep.reduce(self.rep.run(self.step, tf.constant(IMAGES[i]), tf.constant(LABELS[i])))
            losses.append(float(out["loss"]))
        return losses

    def weights(self) -> dict:
        return {v.name + str(i): mesh.to_host(v) for i, v in enumerate(self.model.trainable_variables)}

    def checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.opt)


class MeshTest(TestCase):

    def test_ten_steps_same_weights_on_every_mesh(self):
        runs = {shape: Run(*shape) for shape in ((1, 1), (2, 2), (1, 4))}
        losses = {shape: run.train(0, 10) for shape, run in runs.items()}
        ref = runs[(1, 1)].weights()
        before = Run(1, 1).weights()
        self.assertGreater(max(np.abs(ref[k] - before[k]).max() for k in ref), 1e-3)  # training moved them
        for shape in ((2, 2), (1, 4)):
            np.testing.assert_allclose(losses[shape], losses[(1, 1)], atol=1e-5)
            got = runs[shape].weights()
            for name, value in ref.items():
                np.testing.assert_allclose(got[name], value, atol=1e-5, err_msg=f"{shape} {name}")
        # Memory: on 1x4 each device holds a quarter of each split kernel and of its slots.
        run = runs[(1, 4)]
        mlp = run.model.blocks[0].mlp
        index = {id(v): i for i, v in enumerate(run.model.trainable_variables)}
        for kernel, quarter in ((mlp.up.kernel, (16, 8)), (mlp.down.kernel, (8, 16)),
                                (run.model.blocks[0].attention.query, (16, 1, 4))):
            self.assertEqual(mesh.shard_shapes(kernel), [quarter] * 4)
            for slot in run.opt.slots[index[id(kernel)]]:
                self.assertEqual(mesh.shard_shapes(slot), [quarter] * 4)
                self.assertEqual(mesh.axes_of(slot), mesh.axes_of(kernel))

    @parameterized.named_parameters(("adam", 0.9, 0.999), ("sgd", 0.0, None))
    def test_schedule_sees_the_count_before_the_update_as_keras(self, beta_1, beta_2):
        """A schedule equal to the step: Keras passes 0 at the first update, so it moves
        nothing; MeshAdam used to pass 1 (read after the increment), one step late."""
        class StepSchedule(keras.optimizers.schedules.LearningRateSchedule):
            def __call__(self, step):
                return 0.1 * tf.cast(step, tf.float32)

            def get_config(self):
                return {}

        grads = [np.array([0.5, -1.0, 2.0], np.float32), np.array([1.0, 1.0, -0.5], np.float32),
                 np.array([-0.25, 0.5, 1.0], np.float32)]
        with mesh.use_mesh(mesh.make_mesh({"batch": 1, "model": 1})):
            variable = mesh.variable(lambda: tf.ones([3]), axes=(None,))
            opt = MeshAdam(learning_rate=StepSchedule(), beta_1=beta_1, beta_2=beta_2)
            opt.build([variable])
            step = tf.function(lambda g: opt.apply([g], [variable]))
            got = []
            for g in grads:
                step(mesh.replicate(g))
                got.append(mesh.to_host(variable))
        reference = tf.Variable(tf.ones([3]))
        if beta_2 is None:
            keras_opt = keras.optimizers.SGD(StepSchedule(), momentum=beta_1)
        else:
            keras_opt = keras.optimizers.Adam(StepSchedule(), beta_1=beta_1, beta_2=beta_2, epsilon=1e-7)
        want = []
        for g in grads:
            keras_opt.apply_gradients([(tf.constant(g), reference)])
            want.append(reference.numpy())
        np.testing.assert_array_equal(got[0], np.ones(3))  # rate 0 at the first update
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"after update {i + 1}")

    def test_conv_stem_trains_the_same_on_1x1_and_2x2(self):
        runs = {shape: Run(*shape, stem_widths=(8,)) for shape in ((1, 1), (2, 2))}
        before = mesh.to_host(runs[(1, 1)].model.stem.kernels[0])
        losses = {shape: run.train(0, 4) for shape, run in runs.items()}
        np.testing.assert_allclose(losses[(2, 2)], losses[(1, 1)], atol=1e-5)
        self.assertGreater(np.abs(mesh.to_host(runs[(1, 1)].model.stem.kernels[0]) - before).max(), 1e-3)
        for name, value in runs[(1, 1)].weights().items():
            np.testing.assert_allclose(runs[(2, 2)].weights()[name], value, atol=1e-5, err_msg=name)

    def test_stem_that_does_not_divide_the_patch_is_config_error(self):
        with mesh.use_mesh(mesh.make_mesh({"batch": 1, "model": 1})):
            with self.assertRaisesRegex(ConfigError, r"ViT.stem_widths=\(8, 8, 8\) has 3 stride-2 convolutions: "
                                                     r"8 must divide ViT.patch_size=4"):
                ViT(num_classes=4, image_size=8, patch_size=4, stem_widths=(8, 8, 8))

    def test_checkpoint_from_2x2_resumes_on_1x4_and_4x1(self):
        straight = Run(2, 2)
        want = straight.train(0, 3)
        path = straight.checkpoint().save(os.path.join(self.get_temp_dir(), "ckpt"))
        want += straight.train(3, 6)  # the uninterrupted run
        for shape in ((1, 4), (4, 1)):
            resumed = Run(*shape)
            resumed.checkpoint().restore(path).assert_consumed()
            self.assertEqual(int(mesh.to_host(resumed.opt.iterations)), 3)
            np.testing.assert_allclose(resumed.train(3, 6), want[3:], atol=1e-5, err_msg=str(shape))
            for name, value in straight.weights().items():
                np.testing.assert_allclose(resumed.weights()[name], value, atol=1e-5)

    def test_replicator_interface(self):
        rep = xf.Replicator(target="mesh", mesh_shape={"batch": 2, "model": 2})
        self.assertEqual((rep.num_replicas, rep.num_workers, rep.worker_index, rep.is_chief), (2, 1, 0, True))
        self.assertEqual(rep.check_global_batch(8), 4)
        self.assertEqual(rep.agree(1.0), 1.0)
        out = rep.reduce(rep.run(tf.function(lambda x: {"mean": tf.reduce_mean(x)}), tf.range(8.0)))
        self.assertAllClose(out["mean"], 3.5)

        def input_fn(ctx):
            return tf.data.Dataset.range(32).batch(ctx.get_per_replica_batch_size(8))
        it = iter(rep.distribute(input_fn, global_batch_size=8))
        metrics = rep.run_steps(lambda b: {"first": tf.cast(b[0], tf.float32)}, it, 2)
        self.assertEqual(metrics, {"first": 4.0})  # batches starting at 0 and 8

    def test_gin_bindings(self):
        gin.parse_config(["Replicator.target = 'mesh'", "Replicator.mesh_shape = {'batch': 1, 'model': 4}"])
        rep = xf.Replicator()
        self.assertEqual((rep.target, rep.num_replicas, mesh.model_axis_size(rep.mesh_target.mesh)), ("mesh", 1, 4))

    @parameterized.named_parameters(
        ("size", {"batch": 4, "model": 4}, r"asks for 16 devices"),
        ("axes", {"data": 2, "model": 2}, r"must be a dict with the axes 'batch' and 'model'"),
        ("value", {"batch": 0, "model": 2}, r"\['batch'\]=0 must be a positive integer"))
    def test_bad_mesh_is_config_error(self, shape, message):
        with self.assertRaisesRegex(ConfigError, r"Replicator.mesh_shape.*" + message):
            xf.Replicator(target="mesh", mesh_shape=shape)

    def test_mesh_shape_device_count_mismatch(self):
        with self.assertRaisesRegex(ConfigError, r"Replicator.mesh_shape=.* has 4 positions but 3 device"):
            mesh.make_mesh({"batch": 2, "model": 2}, devices=mesh.mesh_devices(3))
        with self.assertRaisesRegex(ConfigError, r"Replicator.mesh_shape=.* is for Replicator.target='mesh'"):
            xf.Replicator(target="cpu", mesh_shape={"batch": 1, "model": 1})
