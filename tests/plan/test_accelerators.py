"""The planner on accelerators (issue 52): SyncBatchNorm's bytes against closed forms per
target, a GAN step's bytes against a count from GANTask, TPU cores as replicas, strong
and weak scaling, TF32, memory against NVIDIA's recommended batches, the catalogue's
sources and slice limits (the published measurements: test_validation.py)."""

import functools
import os
import re
from unittest import mock

import pytest

from expframe.errors import ConfigError
from expframe.plan import anchors, catalogue, model, planner

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = {"gin_files": ["x.gin"], "global_batch_size": 1024, "train_steps": 1000, "steps_per_loop": 100,
            "precision": "auto", "d4pg": False}


# -- SyncBatchNorm: 2C + 1 float32 shifted sums, all-reduced over its group, per target ---

@pytest.mark.parametrize("n", [2, 8, 512])
@pytest.mark.parametrize("channels", [64, 256])
@pytest.mark.parametrize("group", [None, 2, 8])
def test_sync_batch_norm_bytes_against_closed_forms_per_target(n, channels, group):
    """Forward: one ring all-reduce of 2C + 1 floats over the group (k replicas); backward
    2C; with groups, the moving statistics' averages over all n (2C). Multi-worker
    clusters, which have no group collectives, all-reduce an (n / k)-row table instead."""
    packed = (2 * channels + 1) * 4
    k = n if group is None or group >= n else group

    def ring(m, b):
        return 2 * (m - 1) / m * b

    moving = ring(n, 2 * channels * 4) if k < n else 0.0  # the moving mean and variance averaged
    for target in ("cpu", "gpu", "tpu", "multi_worker"):
        got = model.sync_bn_bytes(target, n, channels, group)
        padded = target == "multi_worker" and k < n
        # Where merge_call keeps the reduction out of a cond, the second pass (C) runs every step.
        every = target == "multi_worker" or (target == "gpu" and k == n)
        payloads = [packed] + ([channels * 4] if every else [])
        want = sum(ring(n, n // k * b) if padded else ring(k, b) for b in payloads)
        back = ring(n, n // k * 2 * channels * 4) if padded else ring(k, 2 * channels * 4)  # d mean, d var: 2C
        assert got["packed"] == packed and got["span"] == k and got["passes"] == payloads
        assert (got["forward"], got["backward"], got["moving"]) == (
            pytest.approx(want), pytest.approx(back), pytest.approx(moving)), target
        # None of it grows with n but the multi-worker padded table (groups there cost n / k rows).
        assert got["forward"] < 2 * (n // k if padded else 1) * (packed + channels * 4)


def test_the_code_all_reduces_2c_plus_1_floats_over_the_group():
    """Facts the closed forms rest on, from the real layer: SyncBatchNorm all-reduces one
    [2C + 1] buffer per call (the shifted sums), over its group."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe.layers.sync_batch_norm import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    from expframe.replicator import collectives  # pylint: disable=import-outside-toplevel
    from tests import support  # pylint: disable=import-outside-toplevel
    rep = support.replicator("cpu", 4)
    with rep.scope():
        whole, grouped = SyncBatchNorm(), SyncBatchNorm(group_size=2)
        for layer in (whole, grouped):
            layer.build((None, 3, 3, 5))  # not in the function: it would be traced twice, to make variables
    seen, statistics, reduce = [], [], collectives.all_reduce

    def recording(x, op="sum", group_size=None):
        if isinstance(x, list):  # Replicator.run's one all-reduce of the statistics' change
            statistics.append(([tuple(t.shape.as_list()) for t in x], op, group_size))
        else:
            seen.append((tuple(x.shape.as_list()), group_size))
        return reduce(x, op, group_size=group_size)
    with mock.patch.object(collectives, "all_reduce", recording):
        rep.local_results(tf.function(lambda: rep.run(
            lambda: (whole(tf.ones([4, 3, 3, 5]), training=True), grouped(tf.ones([4, 3, 3, 5]), training=True))))())
    # forward, per replica: whole (11,) once and its far branch (5,); grouped: the group's
    # (11,) and far (5,); the grouped layer's moving statistics are averaged over all
    # replicas by Replicator.run's one all-reduce at the end of the step (the whole
    # batch's are the same on every replica and left out)
    assert set(seen) == {((5,), None), ((5,), 2), ((11,), None), ((11,), 2)}
    assert seen.count(((11,), None)) == 4 and seen.count(((11,), 2)) == 4 and seen.count(((5,), None)) == 4
    assert statistics == [([(5,), (5,)], "mean", None)] * 4


def test_resnet50_sync_batch_norm_sends_213_kb_per_replica_per_pass_whatever_the_count():
    fp = anchors.experiment_footprint()
    calls = fp.sync_calls()
    assert len(calls) == 53 and all(backward for _, backward, _ in calls)
    assert sum(c for c, _, _ in calls) == 26_560
    packed = sum(model.sync_bn_bytes("tpu", 2, c)["packed"] for c, _, _ in calls)
    assert packed == (2 * 26_560 + 53) * 4 == 212_692
    for n in (2, 512, 2048):  # through each chip, a ring's 2(n-1)/n: under twice the bytes sent
        assert sum(model.sync_bn_bytes("tpu", n, c)["forward"] for c, _, _ in calls) < 2 * packed
        assert sum(model.sync_bn_bytes("tpu", n, c, 8)["forward"] for c, _, _ in calls) < 2 * packed


# -- a GAN step: every update, every batch-norm call ---------------------------------------

def _tiny_gan(disc_steps):
    """A GANTask as tests/tasks/test_gan.py builds it: SN-GAN networks, fake images."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe.models import sngan  # pylint: disable=import-outside-toplevel
    from expframe.tasks import gan  # pylint: disable=import-outside-toplevel
    images = np.random.default_rng(0).uniform(-1, 1, size=(16, 32, 32, 3)).astype(np.float32)

    def dataset(split, ctx, batch_size, training, seed=0, deterministic=False):
        del split, seed, deterministic
        ds = tf.data.Dataset.from_tensor_slices({"image": images, "label": np.arange(16, dtype=np.int32) % 3})
        return (ds.repeat() if training else ds).batch(batch_size, drop_remainder=training)
    return gan.GANTask(generator=functools.partial(sngan.sngan_generator, ch=2, z_dim=8, widths=(2, 2, 1, 1)),
                       discriminator=functools.partial(sngan.sngan_discriminator, ch=1), dataset=dataset,
                       image_size=32, num_classes=3, disc_steps=disc_steps, ema_decay=0.5, feature_network=None)


def test_gan_bytes_per_step_against_a_count_from_gantask():
    """The planner's record of a traced GAN step (5 discriminator updates and a generator
    update) against what GANTask's own objects say the step does."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe.layers.sync_batch_norm import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    from expframe.plan import measure  # pylint: disable=import-outside-toplevel
    from tests import support  # pylint: disable=import-outside-toplevel
    rep = support.replicator("cpu", 1)
    task = _tiny_gan(disc_steps=5)
    task.setup(rep, 8, 0, False)
    with rep.scope():
        task.build()
    with measure.recording_collectives() as record:
        graph = measure._graph(rep, task)  # noqa: SLF001  (the planner's own trace)
    calls = measure.sync_bn_calls(graph, record["sync_bn"])

    # The count from GANTask: disc_steps discriminator updates then one generator update, each
    # all-reducing its network's gradients; the generator's batch norms run in every update,
    # differentiated only in the generator's.
    def nbytes(variables):
        return float(sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in variables))
    d, g = nbytes(task.discriminator.trainable_variables), nbytes(task.generator.trainable_variables)
    assert [r["bytes"] for r in record["all_reduce"]] == [d] * task.disc_steps + [g]
    norms = [int(layer.moving_mean.shape[0]) for layer in task.generator._flatten_layers()  # noqa: SLF001
             if isinstance(layer, SyncBatchNorm)]
    assert norms and not any(isinstance(layer, SyncBatchNorm)
                             for layer in task.discriminator._flatten_layers())  # noqa: SLF001
    assert sorted(calls) == sorted([(c, False, None) for c in norms] * task.disc_steps
                                   + [(c, True, None) for c in norms])
    assert len(calls) == len(norms) * (task.disc_steps + 1)

    # Bytes per step on 8 GPUs of one host: every all-reduce, every batch norm's and the generator's gradients.
    fp = model.Footprint(flops_fixed=0.0, flops_per_example=1e9, param_bytes=d + g, grad_bytes=d + g,
                         slot_bytes=2 * (d + g), activation_bytes_fixed=0.0, activation_bytes_per_example=1e6,
                         num_params=0, sync_collectives=len(calls), all_reduce_bytes=[d] * 5 + [g],
                         sync_bn=[list(c) for c in calls])
    row = model.plan_row(fp, catalogue.published("v100"), 8, 256, model.Settings(None, "mixed_float16"))
    assert row["all_reduce_bytes"] == pytest.approx(5 * d + g)
    closed = sum((task.disc_steps + 1) * model.sync_bn_bytes("gpu", 8, c)["forward"]
                 + model.sync_bn_bytes("gpu", 8, c)["backward"] for c in norms)
    assert row["sync_bn_bytes"] == pytest.approx(closed)
    # Not one update of every model's gradients (what the planner charged before): 4 more of D's.
    assert row["all_reduce_bytes"] - fp.grad_bytes == pytest.approx(4 * d)


# -- TPU cores, scaling, TF32, memory -------------------------------------------------------

FP = model.Footprint(flops_fixed=0.0, flops_per_example=24.7e9, param_bytes=1e8, grad_bytes=1e8, slot_bytes=1e8,
                     activation_bytes_fixed=0.0, activation_bytes_per_example=84e6, num_params=25_000_000)


def test_v3_at_256_chips_plans_512_replicas():
    v3 = catalogue.published("v3")
    plan = planner.make_plan(FP, {}, SETTINGS, v3, [256])
    row = plan["rows"][0]
    assert (row["devices"], row["replicas"], row["per_replica_batch"]) == (256, 512, 2)
    assert row["memory_bytes"]["device"] == 16 * 2 ** 30  # a core's half of the chip's 32 GiB
    # SN-GAN pod256's batch of 256 on 256 chips is half an image per core: refused.
    with pytest.raises(ConfigError, match="not divisible by 512 data-parallel replicas"):
        planner.make_plan(FP, {}, dict(SETTINGS, global_batch_size=256), v3, [256])
    v4 = catalogue.published("v4")  # megacore: one replica per chip
    assert planner.make_plan(FP, {}, SETTINGS, v4, [256])["rows"][0]["replicas"] == 256


def test_h100_at_8_and_256_gpus_no_longer_plans_equal_throughput_at_full_efficiency():
    fp = anchors.experiment_footprint()  # ResNet-50 as experiments/resnet50_imagenet_gpu.gin trains it
    plan = planner.make_plan(fp, {}, SETTINGS, catalogue.published("h100"), [8, 256])
    eight, many = plan["rows"]
    assert plan["compiled"]  # jit_compile 'auto' on a GPU: XLA's launches, not 4,985 executor ops
    assert eight["examples_per_s"] != pytest.approx(many["examples_per_s"], rel=0.05)
    assert eight["strong_efficiency"] == pytest.approx(1.0) and many["strong_efficiency"] < 0.5
    assert many["weak_efficiency"] < 1.0 and eight["weak_efficiency"] < 1.0
    # 4 images per GPU, one GPU per batch-norm group: the device idles, and TensorFlow's fixed cost of
    # a step over several GPUs (fitted on NVIDIA's 1-vs-8-GPU tables) is most of the step.
    assert many["bottleneck"] == "comm" and many["step_sync_s"] > 0.5 * many["comm_s"]
    assert many["grad_all_reduce_s"] + many["sync_bn_s"] < 0.25 * many["step_s"]


def test_dispatch_under_xla_when_the_target_compiles():
    fp = anchors.experiment_footprint()
    h100 = catalogue.published("h100")
    st = model.Settings(None, "mixed_bfloat16")
    compiled = model.plan_row(fp, h100, 1, 8, st)
    uncompiled = model.plan_row(model.Footprint(**{**fp.__dict__, "jit_compile": False}), h100, 1, 8, st)
    device = compiled["step_s"] - compiled["host_s"]
    assert uncompiled["host_s"] == pytest.approx(max(0.0, fp.ops * 5e-6 - device))          # 4,985 ops x 5 us
    assert compiled["host_s"] == pytest.approx(max(0.0, fp.compiled_kernels * 5e-6 - device))  # 485 kernels
    assert model.plan_row(fp, catalogue.published("v3"), 1, 8, st)["host_s"] == 0.0          # a TPU step


def test_float32_on_a100_uses_tf32():
    a100 = catalogue.published("a100")
    assert a100.peak("float32") == 156e12 and a100.peak_key("float32") == "tf32"
    assert "TF32" in a100.peak_note("float32") and a100.efficiency_key("float32") == "u_matrix x tf32_ratio"
    plan = planner.make_plan(FP, {}, SETTINGS, a100, [8], precision="float32")
    assert plan["peak_flops"] == 156e12
    assert plan["utilisation"] == pytest.approx(a100.efficiency["u_matrix"] * a100.efficiency["tf32_ratio"])
    # The same Tensor Cores at 16 bits, and the CUDA cores of a V100 (no TF32) or a P100 (no Tensor Cores).
    assert a100.efficiency_key("mixed_float16") == "u_matrix" and a100.efficiency_key("float32") != "u_vector"
    assert catalogue.published("v100").efficiency_key("float32") == "u_vector"
    assert catalogue.published("p100").efficiency_key("mixed_float16") == "u_vector"
    assert catalogue.published("v3").efficiency_key("float32") == "u_matrix"
    assert catalogue.published("v100").peak("float32") == 15.7e12  # no TF32 before Ampere
    assert catalogue.published("v3").peak("float32") == 123e12      # a TPU: bf16 passes


def test_utilisation_depends_on_precision_and_per_replica_batch():
    v100 = catalogue.published("v100")
    fp = anchors.footprint()
    rows = {(p, b): model.plan_row(fp, v100, 1, b, model.Settings(None, p)) for p in ("float32", "mixed_float16")
            for b in (4, 128)}
    assert rows["mixed_float16", 128]["examples_per_s"] > 2.5 * rows["float32", 128]["examples_per_s"]
    for precision in ("float32", "mixed_float16"):
        assert rows[precision, 4]["utilisation"] < 0.5 * rows[precision, 128]["utilisation"]
    # The bandwidth roof: H100's 16-bit step is bound by HBM, not its 989 TFLOP/s.
    h100 = model.plan_row(fp, catalogue.published("h100"), 1, 256, model.Settings(None, "mixed_float16"))
    assert h100["bottleneck"] == "hbm" and h100["utilisation"] < 0.2


def test_nvidia_recommended_batches_fit_a_16_gb_v100():
    """NGC's ResNet-50: 'Suggested batch sizes for training are 256 for mixed precision training
    and 128 for single precision training per single V100 16 GB.'"""
    fp, v100 = anchors.experiment_footprint(), catalogue.published("v100")
    assert v100.memory_bytes == 16e9
    for batch, precision in ((128, "float32"), (256, "mixed_float16")):
        row = model.plan_row(fp, v100, 1, batch, model.Settings(None, precision))
        assert row["fits"], (batch, precision, row["memory_bytes"])
    assert not model.plan_row(fp, v100, 1, 256, model.Settings(None, "float32"))["fits"]  # twice that does not


# -- the catalogue --------------------------------------------------------------------------

_FIELD_SOURCE = {"per_op_us": "per_op"}


def test_every_catalogue_value_has_a_source_or_says_assumed():
    data = catalogue._load()  # noqa: SLF001
    for name, entry in data["devices"].items():
        for field in set(entry) - {"kind", "aliases", "source"}:
            key = _FIELD_SOURCE.get(field, field)
            assert key in entry["source"], (name, field)
        for field in ("intra_host", "inter_host", "multi_slice"):
            if field in entry:
                assert "latency" in entry["source"], name
        hw = catalogue.published(name)
        for field, text in hw.sources.items():
            assert text and re.search(r"[A-Za-z]{3}", text), (name, field)
    assert "assumed" in catalogue.published("v3").sources["multi_slice"]
    assert "assumed" in catalogue.published("h100").sources["per_op"]


def test_tpu_slice_limits_per_generation():
    limits = {name: catalogue.published(name).max_slice_devices for name in ("v2", "v3", "v4", "v5e", "v5p")}
    assert limits == {"v2": 256, "v3": 1024, "v4": 4096, "v5e": 256, "v5p": 6144}
    v5p = catalogue.published("v5p")
    assert v5p.pod_devices == 8960
    seconds, algorithm, _ = model.all_reduce(v5p, 8192, 1e8)   # more than a slice: two slices over DCN
    assert "slice of 6144 chips" in algorithm and "2 slices" in algorithm
    assert model.all_reduce(v5p, 6144, 1e8)[1] == "3-D torus 24x16x16"


def test_the_v100_is_the_16_gb_card_the_experiment_plans():
    with open(os.path.join(_ROOT, "experiments", "resnet50_imagenet_gpu.gin"), encoding="utf-8") as f:
        text = f.read()
    assert "V100 16 GB" in text and "fits 16 GB" in text
    assert catalogue.published("v100").memory_bytes == 16e9
    assert catalogue.published("v100_32gb").memory_bytes == 32e9


# -- issue 59: the shipped TPU ResNet-50 at pod scale, planned with its batch-norm span -----

def _tpu_resnet50(group):
    """experiments/resnet50_imagenet_tpu.gin's step: anchors.json's ResNet-50 footprint (the
    same model, traced) with its 53 batch norms over groups of `group` cores (None: all)."""
    import dataclasses  # pylint: disable=import-outside-toplevel
    fp = anchors.experiment_footprint()
    if group == "per_device":
        return dataclasses.replace(fp, sync_bn=[], sync_collectives=0, target="tpu")
    return dataclasses.replace(fp, sync_bn=[[c, b, group] for c, b, _ in fp.sync_calls()], target="tpu")


def test_tpu_resnet50_at_1024_chips_keeps_085_of_per_device_batch_norm():
    """At 1,024 v3 chips and batch 32,768 the shipped span (8 cores, MLPerf's) plans within
    0.85 of per-device batch norm; over the whole global batch the 106 all-reduces per step
    cross the pod's torus one after another and halve it (the layer before issue 59: 0.43)."""
    hw, st = catalogue.published("v3"), model.Settings(utilisation=None, precision="mixed_bfloat16")
    rows = {g: model.plan_row(_tpu_resnet50(g), hw, 1024, 32768, st) for g in (8, None, "per_device")}
    per_device = rows["per_device"]["examples_per_s"]
    assert rows[8]["examples_per_s"] / per_device >= 0.85
    assert rows[None]["examples_per_s"] / per_device < 0.6  # the span matters at this scale, not the bytes
    assert rows[8]["sync_bn_bytes"] < 2e6 and rows[None]["sync_bn_bytes"] < 2e6  # MBs, not the 2.61 GB gathered


def test_docs_planning_md_holds_the_tpu_resnet50_rows():
    """docs/planning.md's TPU ResNet-50 tables (the planner's command line, which traces the
    experiment) against the model on the stored footprint: the same images/s."""
    with open(os.path.join(_ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        doc = f.read()
    section = doc[doc.index("## ResNet-50 on TPU v3"):doc.index("## ResNet-50 on H100")]
    hw, st = catalogue.published("v3"), model.Settings(utilisation=None, precision="mixed_bfloat16")
    for chips in (8, 64, 256, 1024):
        shipped = model.plan_row(_tpu_resnet50(8), hw, chips, 32768, st)
        per_device = model.plan_row(_tpu_resnet50("per_device"), hw, chips, 32768, st)
        share = f"| {chips:,} | {shipped['sync_bn_bytes'] / 1e6:.2f} MB | {shipped['sync_bn_s'] * 1e3:.2f} | "
        assert share in section, share
        assert f"| {shipped['examples_per_s']:,.0f} | {per_device['examples_per_s']:,.0f} | " in section
