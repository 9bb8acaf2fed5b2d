"""The planner's model (expframe/plan/model.py): all-reduce formulas against their closed
forms, step time and memory of a plan row, scaling efficiency. Plain Python, no TensorFlow."""

import dataclasses
import math

import pytest

from expframe.plan import catalogue, model
from expframe.plan.catalogue import Link

LINK = Link("test", bandwidth=10e9, latency_s=1e-6)
GB = 1e9


def test_ring_all_reduce_is_reduce_scatter_plus_all_gather():
    # n = 8: each device sends and receives 2 x 7/8 of the bytes, in 2 x 7 latency-bound steps.
    assert model.ring_all_reduce_s(GB, 8, LINK) == pytest.approx(2 * 7 / 8 * 0.1 + 14e-6)
    assert model.ring_all_reduce_s(GB, 1, LINK) == 0.0
    # Bandwidth term tends to 2 x bytes / bandwidth for large rings.
    assert model.ring_all_reduce_s(GB, 10_000, Link("x", 10e9, 0.0)) == pytest.approx(0.2, rel=1e-3)


def test_hierarchical_all_reduce_adds_a_ring_over_hosts_at_the_host_network():
    inter = Link("net", bandwidth=5e9, latency_s=1e-5)
    # 8 devices per host, 4 hosts: ring of 8 on LINK + 2 x 3/4 x bytes / 5 GB/s + 2 x 3 x 10 us.
    expected = (2 * 7 / 8 * 0.1 + 14e-6) + (2 * 3 / 4 * GB / 5e9 + 6e-5)
    assert model.hierarchical_all_reduce_s(GB, 8, 4, LINK, inter) == pytest.approx(expected)
    assert model.hierarchical_all_reduce_s(GB, 8, 1, LINK, inter) == model.ring_all_reduce_s(GB, 8, LINK)


@pytest.mark.parametrize("n, ndim, shape", [(256, 2, (16, 16)), (32, 2, (8, 4)), (8, 2, (4, 2)), (64, 3, (4, 4, 4)),
                                            (512, 3, (8, 8, 8)), (7, 2, (7, 1)), (1, 3, (1, 1, 1))])
def test_torus_dims_are_balanced(n, ndim, shape):
    assert model.torus_dims(n, ndim) == shape


def test_torus_all_reduce_is_bandwidth_optimal_with_a_ring_latency_per_dimension():
    # 16 x 16: 2 x 255/256 x bytes / B + 2 x (15 + 15) x latency.
    assert model.torus_all_reduce_s(GB, (16, 16), LINK) == pytest.approx(2 * 255 / 256 * 0.1 + 60e-6)
    # Google's per-pod all-reduce bandwidth of a v3 pod, 340 TB/s over 1,024 chips, is the catalogue's per-chip link.
    v3 = catalogue.published("v3")
    assert v3.inter_host.bandwidth * 1024 == pytest.approx(340e12, rel=0.01)


def test_small_all_reduce_is_a_tree():
    assert model.small_all_reduce_s(256, LINK) == pytest.approx(2 * 8 * 1e-6)
    assert model.small_all_reduce_s(1, LINK) == 0.0


def test_gradient_all_reduce_picks_the_targets_algorithm():
    a100 = catalogue.published("a100")  # NCCL: a ring's bytes, a tree's 2 log2 n latencies
    seconds, algorithm, _ = model.gradient_all_reduce(a100, 8, GB)
    assert "over 8" in algorithm and seconds == model.ring_all_reduce_s(GB, 8, a100.intra_host, tree=True)
    assert model.ring_all_reduce_s(GB, 8, a100.intra_host, tree=True) == pytest.approx(
        2 * 7 / 8 * GB / a100.intra_host.bandwidth + 2 * 3 * a100.intra_host.latency_s)
    seconds, algorithm, _ = model.gradient_all_reduce(a100, 32, GB)
    assert algorithm.startswith("hierarchical")
    assert seconds == pytest.approx(model.hierarchical_all_reduce_s(GB, 8, 4, a100.intra_host, a100.inter_host,
                                                                    tree=True))
    v4 = catalogue.published("v4")
    seconds, algorithm, _ = model.gradient_all_reduce(v4, 64, GB)
    assert algorithm == "3-D torus 4x4x4"
    assert seconds == pytest.approx(model.torus_all_reduce_s(GB, (4, 4, 4), v4.inter_host))
    v5e = catalogue.published("v5e")  # beyond a 256-chip pod: a ring over DCN between slices
    seconds, algorithm, _ = model.gradient_all_reduce(v5e, 512, GB)
    inside = model.torus_all_reduce_s(GB, (16, 16), v5e.inter_host)
    across = model.ring_all_reduce_s(GB * 8 / 256, 2, v5e.multi_slice)
    assert "2 slices" in algorithm and seconds == pytest.approx(inside + across)


FP = model.Footprint(flops_fixed=1e9, flops_per_example=10e9, param_bytes=4e8, grad_bytes=4e8, slot_bytes=8e8,
                     activation_bytes_fixed=0.0, activation_bytes_per_example=1e8, num_params=10**8)


def test_plan_row_step_time_and_memory():
    hw = catalogue.published("a100")
    st = model.Settings(utilisation=0.5, precision="mixed_bfloat16")
    row = model.plan_row(FP, hw, 16, 512, st)
    assert row["per_replica_batch"] == 32
    # Two roofs: compute at the stated efficiency (and the GPU's fill batch), HBM traffic at the bandwidth.
    compute = (1e9 + 10e9 * 32) / (312e12 * 0.5) * (1 + hw.fill_batch / 32)
    traffic = hw.traffic() * 0.5 * 32 * 1e8 + (2 * 4e8 + 4e8 + 2 * 8e8)   # 16-bit activations; the optimizer's pass
    memory = traffic / 2039e9
    dev = model.device_time(FP, hw, 32, "mixed_bfloat16", 0.5)
    assert (dev["compute_roof_s"], dev["hbm_roof_s"]) == (pytest.approx(compute), pytest.approx(memory))
    # The longer roof in full, the shorter's serial part: 'serial' of it does not hide under the longer.
    serial = hw.efficiency["serial"]
    assert 0 < serial < 1
    assert row["compute_s"] + row["hbm_s"] == pytest.approx(max(compute, memory) + serial * min(compute, memory))
    assert max(row["compute_s"], row["hbm_s"]) == pytest.approx(max(compute, memory))
    # Two hosts of 8 GPUs: the hierarchical all-reduce, and TensorFlow's fixed cost of a step over several GPUs.
    all_reduce = model.hierarchical_all_reduce_s(4e8, 8, 2, hw.intra_host, hw.inter_host, tree=True)
    assert row["step_sync_s"] == hw.efficiency["step_sync_s"] > 0
    assert row["comm_s"] == pytest.approx(all_reduce + row["step_sync_s"])
    assert row["step_s"] == pytest.approx(row["compute_s"] + row["hbm_s"] + row["comm_s"])
    assert row["examples_per_s"] == pytest.approx(512 / row["step_s"])
    memory = row["memory_bytes"]
    assert memory["activations"] == pytest.approx(32 * 1e8 * 0.5)  # 16-bit activations
    assert memory["total"] == pytest.approx(4e8 + 4e8 + 8e8 + 1.6e9) and row["fits"]
    # One GPU pays no synchronisation; neither does a stack without TensorFlow's (MXNet's), nor a TPU.
    assert model.plan_row(FP, hw, 1, 32, st)["step_sync_s"] == 0.0
    assert model.plan_row(FP, hw, 16, 512, model.Settings(0.5, "mixed_bfloat16", stack=model.Stack(
        "mxnet", "traffic_fused", step_sync=False)))["step_sync_s"] == 0.0
    assert model.plan_row(FP, catalogue.published("v4"), 16, 512, st)["step_sync_s"] == 0.0


def test_a_plan_that_does_not_fit_names_its_shortfall():
    hw = catalogue.published("v5e")  # 16 GB
    row = model.plan_row(FP, hw, 1, 512, model.Settings(utilisation=0.3, precision="float32"))
    need = 4e8 + 4e8 + 8e8 + 512 * 1e8
    assert not row["fits"] and row["bottleneck"] == "memory"
    assert row["shortfall_bytes"] == pytest.approx(need - 16e9)


def test_weak_efficiency_against_one_device_at_the_same_per_replica_batch():
    hw = catalogue.published("v100")
    st = model.Settings(utilisation=0.3, precision="mixed_float16")
    rows = [model.plan_row(FP, hw, n, 32 * n, st) for n in (1, 8, 64)]
    model.add_efficiency(rows, FP, hw, st)
    assert rows[0]["weak_efficiency"] == pytest.approx(1.0)
    for row in rows[1:]:
        assert row["weak_efficiency"] == pytest.approx(rows[0]["step_s"] / row["step_s"])
        assert row["weak_efficiency"] < 1.0
        assert row["strong_efficiency"] is None  # the global batch changed: no strong-scaling figure


def test_strong_efficiency_against_the_smallest_device_count_at_the_same_global_batch():
    hw = catalogue.published("v100")
    st = model.Settings(utilisation=0.3, precision="mixed_float16")
    rows = [model.plan_row(FP, hw, n, 512, st) for n in (8, 64)]
    model.add_efficiency(rows, FP, hw, st)
    eight, sixty_four = rows
    assert eight["strong_efficiency"] == pytest.approx(1.0) and eight["efficiency"] == eight["strong_efficiency"]
    assert sixty_four["strong_efficiency"] == pytest.approx(
        sixty_four["examples_per_s"] / (8 * eight["examples_per_s"]))
    # 8 images per GPU on 64: the GPU idles at a small batch and communication grows, so strong
    # scaling falls below weak (which compares 64 GPUs with one at the same 8 images).
    assert sixty_four["strong_efficiency"] < sixty_four["weak_efficiency"] < 1.0


def test_shared_compute_logical_cpu_replicas_do_not_add_compute():
    cpu = catalogue.measured_cpu(achieved_flops=1e11, copy_bandwidth=5e9)
    st = model.Settings(utilisation=1.0, precision="float32")
    one, four = (model.plan_row(FP, cpu, n, 8, st) for n in (1, 4))
    # The same global batch on one pool of cores: the same compute, plus 4 replicas' fixed cost.
    assert four["compute_s"] == pytest.approx((4 * 1e9 + 8 * 10e9) / 1e11)
    assert one["compute_s"] == pytest.approx((1e9 + 8 * 10e9) / 1e11)
    assert four["comm_s"] == pytest.approx(model.ring_all_reduce_s(4e8, 4, cpu.intra_host))


def test_schedule_columns():
    row = {"examples_per_s": 1000.0, "step_s": 0.5}
    model.add_schedule(row, 1_281_167, 112_590)
    assert row["epoch_s"] == pytest.approx(1281.167) and row["to_last_step_s"] == pytest.approx(56_295)
    model.add_schedule(row, None, 10)
    assert row["epoch_s"] is None and math.isclose(row["to_last_step_s"], 5.0)


def test_calibrated_utilisation_reproduces_the_measured_step():
    cpu = catalogue.measured_cpu(achieved_flops=1e11, copy_bandwidth=5e9, per_op_s=1e-5)
    fp = model.Footprint(**{**FP.__dict__, "ops": 500})
    st = model.Settings(utilisation=1.0, precision="float32")
    u = model.calibrated_utilisation(fp, cpu, 1, 8, st, measured_step_s=2.0)
    row = model.plan_row(fp, cpu, 1, 8, model.Settings(utilisation=u, precision="float32"))
    assert row["step_s"] == pytest.approx(2.0)
    assert row["host_s"] == pytest.approx(500 * 1e-5)  # dispatch on the CPU adds to the step
    with pytest.raises(ValueError, match="nothing left"):
        model.calibrated_utilisation(fp, cpu, 1, 8, st, measured_step_s=1e-3)


def test_two_one_replica_steps_separate_compute_from_host_time():
    """calibrated_host: from steps at batch 120 and 15 on one replica, the utilisation and the
    per-op host time that reproduce both; shared cores then pay the host time once per replica."""
    cpu = catalogue.measured_cpu(achieved_flops=1e11, copy_bandwidth=5e9)
    fp = model.Footprint(**{**FP.__dict__, "ops": 1000, "grad_bytes": 0.0})
    st = model.Settings(utilisation=1.0, precision="float32")
    # Made-up truth: utilisation 0.25, 5 us per op.
    truth = dataclasses.replace(cpu, per_op_s=5e-6)
    at = {b: model.plan_row(fp, truth, 1, b, dataclasses.replace(st, utilisation=0.25))["step_s"] for b in (120, 15)}
    u, per_op = model.calibrated_host(fp, cpu, 120, 15, st, at[120], at[15])
    assert (u, per_op) == (pytest.approx(0.25), pytest.approx(5e-6))
    two_cores = dataclasses.replace(cpu, per_op_s=per_op, cores=2)
    four = model.plan_row(fp, two_cores, 4, 120, dataclasses.replace(st, utilisation=u))
    assert four["host_s"] == pytest.approx(4 / 2 * 1000 * 5e-6)   # 4 replicas' dispatch, 2 at once
    assert model.plan_row(fp, two_cores, 2, 120, st)["host_s"] == pytest.approx(1000 * 5e-6)
    assert four["compute_s"] == pytest.approx(4 * fp.flops(30) / (1e11 * 0.25))
    with pytest.raises(ValueError, match="must take longer"):
        model.calibrated_host(fp, cpu, 120, 15, st, 0.01, 0.02)
    # Examples cheaper at the small batch (no host time left): the large batch alone calibrates.
    probe = dataclasses.replace(cpu, per_op_s=1e-6)
    u, per_op = model.calibrated_host(fp, probe, 120, 15, st, at[120], at[15] / 4)
    assert per_op == 1e-6 and model.plan_row(fp, probe, 1, 120, dataclasses.replace(st, utilisation=u))[
        "step_s"] == pytest.approx(at[120])


def test_a_measured_sync_layer_cost_replaces_the_formula():
    cpu = catalogue.measured_cpu(achieved_flops=1e11, copy_bandwidth=5e9)
    fp = model.Footprint(**{**FP.__dict__, "sync_collectives": 7, "sync_bn": [[64, True]] * 7, "grad_bytes": 0.0})
    plain = model.Footprint(**{**FP.__dict__, "sync_collectives": 0, "sync_bn": [], "grad_bytes": 0.0})
    st = model.Settings(utilisation=1.0, precision="float32")

    def sync_s(hw, n):
        return model.plan_row(fp, hw, n, 120, st)["comm_s"] - model.plan_row(plain, hw, n, 120, st)["comm_s"]
    # The formula: each call's all-reduce of 2 x 64 + 1 float32 sums forward, 2 x 64 backward.
    packed, back = (2 * 64 + 1) * 4, 2 * 64 * 4

    def call_s(n):
        return model.ring_all_reduce_s(packed, n, cpu.intra_host) + model.ring_all_reduce_s(back, n, cpu.intra_host)
    assert sync_s(cpu, 4) == pytest.approx(7 * call_s(4))
    measured = dataclasses.replace(cpu, sync_layer_s={2: 1e-3, 4: 2e-3})
    assert sync_s(measured, 4) == pytest.approx(7 * 2e-3)
    assert sync_s(measured, 8) == pytest.approx(7 * call_s(8))
    assert sync_s(measured, 1) == 0.0
    # A call the step does not differentiate through (a GAN's generator in a discriminator update) costs
    # the forward all-reduce only: half the measured layer.
    forward_only = model.Footprint(**{**fp.__dict__, "sync_bn": [[64, False]] * 7})
    assert model.plan_row(forward_only, measured, 4, 120, st)["comm_s"] == pytest.approx(7 * 1e-3)


def test_examples_per_s_counts_what_a_step_consumes():
    # A GAN step takes disc_steps sub-batches of real images: 5 x the global batch per step.
    gan = model.Footprint(**{**FP.__dict__, "examples_per_step_factor": 5.0})
    hw, st = catalogue.published("v3"), model.Settings(utilisation=0.3, precision="mixed_bfloat16")
    assert model.plan_row(gan, hw, 8, 256, st)["examples_per_s"] == pytest.approx(
        5 * model.plan_row(FP, hw, 8, 256, st)["examples_per_s"])
