"""The planner on accelerators (issue 52): SyncBatchNorm's bytes against closed forms per
target, a GAN step's bytes against a count from GANTask, TPU cores as replicas, strong
and weak scaling, TF32, memory against NVIDIA's recommended batches, the catalogue's
sources and slice limits, and the anchors table against published measurements (with
docs/planning.md holding the generated table)."""

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


# -- SyncBatchNorm: the n x 3C float32 table, per target ------------------------------------

@pytest.mark.parametrize("n", [2, 8, 512])
@pytest.mark.parametrize("channels", [64, 256])
def test_sync_batch_norm_bytes_against_closed_forms_per_target(n, channels):
    """Forward: the gather as each target implements it; backward: the gather's gradient, an
    all-reduce of the whole table. Bytes through the busiest device's links, one call."""
    piece = 3 * channels * 4               # this replica's (count, mean, M2), float32
    table = n * piece                       # what every replica ends with
    ring_gather, ring_reduce = (n - 1) / n * table, 2 * (n - 1) / n * table
    expected = {
        "multi_worker": (ring_gather, ring_reduce),                # CollectiveAllReduce: a ring all-gather
        "tpu": (ring_reduce, ring_reduce),                         # TPUStrategy: a sum of the zero-padded table
        "gpu": ((n - 1) * piece + (n - 1) * table, ring_reduce),   # NCCL has no gather: to GPU 0, copied out
    }
    if n * 3 * channels <= 1 << 18:          # CPU replicas: the framework's own CollectiveReduce, padded
        expected["cpu"] = (ring_reduce, ring_reduce)
    else:                                    # larger tables: the strategy's, through one device
        expected["cpu"] = ((n - 1) * piece + (n - 1) * table, 2 * (n - 1) * table)
    for target, (forward, backward) in expected.items():
        got = model.sync_bn_bytes(target, n, channels)
        assert got["table"] == table
        assert (got["forward"], got["backward"]) == (pytest.approx(forward), pytest.approx(backward)), target
    # The CPU's padded all-reduce moves twice the bytes of a gather.
    if n * 3 * channels <= 1 << 18:
        assert model.sync_bn_bytes("cpu", n, channels)["forward"] == pytest.approx(
            2 * model.sync_bn_bytes("multi_worker", n, channels)["forward"])


def test_the_code_gathers_a_replicas_x_3c_table_and_the_own_collective_limit_is_the_codes():
    """Facts the closed forms rest on, from the real layer: SyncBatchNorm gathers [1, 3C] per
    replica into [n, 3C]; CPU replicas use their own collective up to 2^18 elements."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe.layers.sync_batch_norm import SyncBatchNorm  # pylint: disable=import-outside-toplevel
    from expframe.replicator import collectives  # pylint: disable=import-outside-toplevel
    from tests import support  # pylint: disable=import-outside-toplevel
    assert model.OWN_COLLECTIVE_MAX_ELEMENTS == collectives._OWN_MAX_ELEMENTS  # noqa: SLF001
    rep = support.replicator("cpu", 2)
    with rep.scope():
        layer = SyncBatchNorm()
    seen, gather = [], collectives.all_gather

    def recording(x, axis=0):
        out = gather(x, axis)
        seen.append((x.shape.as_list(), out.shape.as_list()))
        return out
    with mock.patch.object(collectives, "all_gather", recording):
        rep.local_results(tf.function(lambda: rep.run(lambda: layer(tf.ones([4, 3, 3, 5]), training=True)))())
    assert seen and all(s == ([1, 15], [2, 15]) for s in seen)


def test_resnet50_sync_batch_norm_table_is_319_kb_per_replica_and_163_mb_on_512_cores():
    fp = anchors.experiment_footprint()
    calls = fp.sync_calls()
    assert len(calls) == 53 and all(backward for _, backward in calls)
    per_replica = sum(model.sync_bn_bytes("tpu", 2, c)["table"] / 2 for c, _ in calls)
    assert per_replica == 3 * 26_560 * 4 == 318_720
    assert sum(model.sync_bn_bytes("tpu", 512, c)["table"] for c, _ in calls) == pytest.approx(163.2e6, rel=1e-3)


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
    assert sorted(calls) == sorted([(c, False) for c in norms] * task.disc_steps + [(c, True) for c in norms])
    assert len(calls) == len(norms) * (task.disc_steps + 1)

    # Bytes per step on 8 GPUs of one host: every all-reduce, every gather and the generator's gradients.
    fp = model.Footprint(flops_fixed=0.0, flops_per_example=1e9, param_bytes=d + g, grad_bytes=d + g,
                         slot_bytes=2 * (d + g), activation_bytes_fixed=0.0, activation_bytes_per_example=1e6,
                         num_params=0, sync_collectives=len(calls), all_reduce_bytes=[d] * 5 + [g],
                         sync_bn=[[c, b] for c, b in calls])
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
    assert many["bottleneck"] == "comm"  # 4 images per GPU: SyncBatchNorm's gathers across 32 hosts


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
    assert "TF32" in a100.peak_note("float32") and a100.efficiency_key("float32") == "gpu_tf32"
    plan = planner.make_plan(FP, {}, SETTINGS, a100, [8], precision="float32")
    assert plan["peak_flops"] == 156e12 and plan["utilisation"] == a100.efficiency["gpu_tf32"]
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

_FIELD_SOURCE = {"per_op_us": "per_op", "efficiency_keys": "utilisation"}


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


# -- the anchors ----------------------------------------------------------------------------

def test_the_anchors_table_holds_against_published_measurements():
    data = anchors.load()
    rows = anchors.table(data)
    s = anchors.summary(rows)
    assert len(rows) >= 10 and {r["device"].split("_")[0] for r in rows} >= {"p100", "v100", "a100", "h100", "v3",
                                                                              "v4"}
    assert s["median_abs_error"] <= 0.20 and s["worst_ratio"] <= 1.5
    assert s["held_out"] >= 3 and s["held_out_devices"] >= 2
    assert s["held_out_median_abs_error"] <= 0.20
    for r in rows:
        assert r["role"] in ("fitted", "held out") and r["source"] in data["sources"] and r["derivation"]
    assert {r["precision"] for r in rows} >= {"float32", "mixed_float16", "mixed_bfloat16"}
    assert any(r["device"].startswith("a100") and r["precision"] == "float32" for r in rows)  # TF32


def test_the_fit_reproduces_the_catalogues_parameters():
    stored = catalogue.efficiency_parameters()
    for name, value in anchors.fit().items():
        assert value == pytest.approx(stored[name], rel=0.02, abs=0.005), name


def test_docs_planning_md_holds_the_generated_anchors_table():
    with open(os.path.join(_ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        doc = f.read()
    found = re.search(r"<!-- anchors:begin[^>]*-->\n(.*?)\n<!-- anchors:end -->", doc, re.S)
    assert found, "docs/planning.md lost its anchors markers"
    assert found.group(1).strip() == anchors.markdown().strip(), (
        "docs/planning.md's anchors table is stale: regenerate it with python -m expframe.plan.anchors")
