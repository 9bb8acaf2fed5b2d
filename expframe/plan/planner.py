"""Puts a plan together: the experiment's measured footprint, a device type and the
stated inputs -> rows of predicted time, memory and scaling (see model.py)."""

import dataclasses
import statistics
from typing import Dict, Optional, Sequence

from expframe import epochs
from expframe.errors import ConfigError
from expframe.plan import catalogue, datasheet, input_bound, input_rate, model
from expframe.plan.catalogue import Hardware

# 'auto' precision per device kind (experiment.py: the fastest measured; bfloat16 on TPU).
_AUTO_PRECISION = {"tpu": "mixed_bfloat16", "cpu": "float32"}


def resolve_precision(precision: str, hw: Hardware) -> str:
    """The Keras policy a run would use on `hw`: as bound, or for 'auto' bfloat16 on a TPU,
    16-bit on a GPU (bfloat16 where it has a bf16 peak, else float16), float32 on a CPU."""
    if precision != "auto":
        return precision
    if hw.kind == "gpu":
        return "mixed_bfloat16" if "bf16" in hw.peak_flops else "mixed_float16"
    return _AUTO_PRECISION.get(hw.kind, "float32")


def cpu_flops(repeats: int = 5) -> float:
    """This machine's achieved float32 FLOP/s: the replicator's precision probe (a chain of
    matmuls and 3x3 convolutions), its FLOPs counted by the profiler, its time the median of runs."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe.plan import measure  # pylint: disable=import-outside-toplevel
    from expframe.replicator import probes  # pylint: disable=import-outside-toplevel
    n, batch, side, channels, chain = probes._PRECISION_SIZES["CPU"]  # noqa: SLF001  (the probe's own sizes)
    graph = probes._chain.get_concrete_function(  # noqa: SLF001
        tf.TensorSpec((n, n)), tf.TensorSpec((n, n)), tf.TensorSpec((batch, side, side, channels)),
        tf.TensorSpec((3, 3, channels, channels)), chain).graph
    flops = measure.graph_flops(graph)
    timer = probes.precision_timer("/device:CPU:0")
    return flops / statistics.median(timer("float32") for _ in range(repeats))


def cpu_per_op_s(length: int = 2000, repeats: int = 5) -> float:
    """This machine's executor time per op: a traced chain of `length` scalar sines
    (each needs the last), the median of runs divided by its length."""
    import time  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    @tf.function
    def chain(x):
        for _ in range(length):
            x = tf.math.sin(x)  # nothing for Grappler to fold or fuse
        return x

    x = tf.constant(0.0)
    chain(x).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        chain(x).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / length


def with_sync_probe(hw: Hardware, devices: Sequence[int], most: int = 16) -> Hardware:
    """'This machine' with the cost of one synchronised batch-norm layer measured on each of
    `devices` logical CPU replicas (2 to `most`; `collective_probe`, a few seconds each)."""
    import sys  # pylint: disable=import-outside-toplevel

    from expframe.plan import collective_probe  # pylint: disable=import-outside-toplevel
    measured = {}
    for n in sorted({n for n in devices if 1 < n <= most}):
        print(f"measuring a synchronised batch-norm layer on {n} logical CPU replicas", file=sys.stderr, flush=True)
        measured[n] = collective_probe.measure("cpu", n)
    return dataclasses.replace(hw, sync_layer_s=measured,
                               sources=dict(hw.sources, sync_layer="measured: expframe.plan.collective_probe"))


def hardware(name: str, devices_per_host: Optional[int] = None, inter_host_gbps: Optional[float] = None,
             latency_us: Optional[float] = None, cpu_flops_measured: Optional[float] = None,
             host_cores_per_device: Optional[float] = None) -> Hardware:
    """The catalogue's entry, a device described by its datasheet (a .json file), or 'cpu'
    (measured now), with the stated overrides applied (a host's CPU cores per device among
    them: the host of an accelerator)."""
    if name.lower() == "cpu":
        hw = catalogue.measured_cpu(cpu_flops_measured if cpu_flops_measured is not None else cpu_flops(),
                                    per_op_s=cpu_per_op_s())
    elif datasheet.is_datasheet(name):
        hw = datasheet.load(name)
    else:
        hw = catalogue.published(name)
    changes = {}
    if devices_per_host is not None:
        changes["devices_per_host"] = devices_per_host
    if inter_host_gbps is not None:
        changes["inter_host"] = dataclasses.replace(hw.inter_host, name=f"{inter_host_gbps:g} Gbit/s (stated)",
                                                    bandwidth=inter_host_gbps * 1e9 / 8)
    if latency_us is not None:
        for key in ("intra_host", "inter_host"):
            changes[key] = dataclasses.replace(changes.get(key, getattr(hw, key)), latency_s=latency_us * 1e-6)
    if host_cores_per_device is not None and not hw.shared_compute:
        changes["host_cores_per_device"] = host_cores_per_device
        changes["host_cpu"] = f"{host_cores_per_device:g} cores per device (stated: --host_cores_per_device)"
    return dataclasses.replace(hw, **changes) if changes else hw


def make_plan(fp: model.Footprint, details: Dict, settings: Dict, hw: Hardware, devices: Sequence[int],
              global_batch_size: Optional[int] = None, utilisation: Optional[float] = None,
              precision: Optional[str] = None, input_us_per_example: Optional[float] = None,
              host_ms_per_call: float = 0.0, actors: Optional[int] = None, actor_steps_per_s: Optional[float] = None,
              host_core_factor: float = 1.0, rate: Optional[input_rate.InputRate] = None) -> Dict:
    """The plan (a JSON-able dict with `rows`) for each device count in `devices`. The
    input: `input_us_per_example` where stated, else predicted from the measured per-core
    `rate` (default: input_rate.json) x `host_core_factor` where it applies
    (`input_bound.choose`), else assumed to keep up."""
    batch = global_batch_size or settings["global_batch_size"]
    chosen = resolve_precision(precision or settings["precision"], hw)
    inp = input_bound.choose(settings, hw, input_us_per_example, host_core_factor, rate)
    st = model.Settings(utilisation=utilisation, precision=chosen, input_s_per_example=inp.s_per_example,
                        input_core_s_per_example=inp.core_s_per_example, host_call_s=host_ms_per_call * 1e-3,
                        steps_per_loop=settings["steps_per_loop"])
    train_steps = planned_train_steps(settings, details, fp, batch)
    axis = max(1, fp.model_axis)
    cores = max(1, hw.cores_per_chip)
    rows = []
    for n in devices:
        if n % axis:
            raise ConfigError(f"--devices={n}: the experiment's mesh has a model axis of {axis}; use multiples of it.")
        replicas = n // axis * cores
        if batch % replicas:
            per_chip = f" ({n // axis} chips x {cores} cores)" if cores > 1 else ""
            raise ConfigError(f"--devices={n}: global batch {batch} is not divisible by {replicas} data-parallel "
                              f"replicas{per_chip}; pass --global_batch_size or other device counts.")
        row = model.plan_row(fp, hw, n, batch, st)
        model.add_schedule(row, details.get("examples_per_epoch"), train_steps)
        rows.append(row)
    model.add_efficiency(rows, fp, hw, st)
    efficiency = utilisation if utilisation is not None else hw.compute_efficiency(chosen)
    plan = {"gin_files": settings["gin_files"], "hardware": hw.name, "datasheet": hw.datasheet, "precision": chosen,
            "peak_note": hw.peak_note(chosen), "peak_flops": hw.peak(chosen), "utilisation": efficiency,
            "utilisation_source": _utilisation_source(hw, chosen, utilisation),
            "cores_per_chip": cores, "compiled": model.compiles(fp, hw, st),
            "overlap": hw.overlap, "sources": hw.sources, "train_steps": train_steps,
            "train_epochs": settings.get("train_epochs"),
            "examples_per_epoch": details.get("examples_per_epoch"), "rows": rows,
            "input_note": inp.note, "input": inp.as_dict(), "devices_per_host": hw.devices_per_host,
            "host_cpu": hw.host_cpu, "host_cores_per_device": hw.host_cores_per_device,
            "host_note": f"{host_ms_per_call:g} ms per host call of {st.steps_per_loop} steps (--host_ms)",
            "measured": dict(details, precision_measured="float32"), "footprint": _footprint_fields(fp)}
    if settings.get("d4pg"):
        plan["d4pg_lines"], plan["d4pg"] = _d4pg(plan, settings, batch, actors, actor_steps_per_s)
    return plan


def planned_train_steps(settings: Dict, details: Dict, fp: model.Footprint, batch: int) -> int:
    """The run's last step: `Trainer.train_steps`, or `Trainer.train_epochs` in steps as the
    trainer counts them (expframe/epochs.py) at the planned global batch, so a plan at
    another --global_batch_size has the steps that run would have."""
    if settings.get("train_steps") is not None:
        return settings["train_steps"]
    per_step = round(batch * fp.examples_per_step_factor) * details.get("accumulate_steps", 1)
    what = f"the experiment ({', '.join(settings['gin_files'])})"
    per_epoch = epochs.steps_per_epoch(details.get("examples_per_epoch"), per_step, what)
    return epochs.steps("Trainer.train_epochs", settings["train_epochs"], per_epoch)


def _utilisation_source(hw: Hardware, precision: str, stated: Optional[float]) -> str:
    if stated is not None:
        return "stated (--utilisation)"
    if hw.kind == "cpu":
        return hw.sources.get("utilisation", "")
    key = hw.efficiency_key(precision)
    return (f"the compute roof's efficiency {key}, shared by every {hw.kind.upper()} and fitted to published "
            f"ResNet-50 measurements (expframe/plan/anchors.json; docs/planning.md); HBM traffic "
            f"{hw.traffic():.3g} x saved activations, fill batch {hw.fill_batch:.3g}")


def _footprint_fields(fp: model.Footprint) -> Dict:
    return dataclasses.asdict(fp)


def _d4pg(plan: Dict, settings: Dict, batch: int, actors: Optional[int], actor_steps_per_s: Optional[float]):
    """Learner steps/s against the actors' environment steps/s (a simple, stated model): a
    learner step needs batch / samples_per_insert new environment steps; K actors make K x
    one actor's rate. The slower side sets the pace."""
    k = actors if actors is not None else max(1, settings.get("num_actors") or 1)
    rate = actor_steps_per_s or plan["measured"].get("actor_env_steps_per_s")
    per_step = batch / (settings.get("samples_per_insert") or 1.0)
    lines, out = [], []
    for row in plan["rows"]:
        learner = 1.0 / row["step_s"]
        needed = learner * per_step
        have = k * rate if rate else None
        pace = min(learner, have / per_step) if have else learner
        out.append({"devices": row["devices"], "learner_steps_per_s": learner, "env_steps_needed_per_s": needed,
                    "actors": k, "actor_env_steps_per_s": have, "paced_learner_steps_per_s": pace})
        side = "-" if have is None else ("actors" if have < needed else "learner")
        lines.append(f"{row['devices']} devices, D4PG: learner {learner:,.1f} steps/s needs {needed:,.0f} environment "
                     f"steps/s ({per_step:g} per step); {k} actor(s) make "
                     f"{'?' if have is None else f'{have:,.0f}'}/s -> {pace:,.1f} learner steps/s, bound by {side}")
    return lines, out
