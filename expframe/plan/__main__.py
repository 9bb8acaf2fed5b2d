"""`python -m expframe.plan`: predicted step time, memory and scaling of an experiment on N devices.

    python -m expframe.plan --gin_file=experiments/resnet50_imagenet_tpu.gin --hardware=v3 --devices=8,32,256
    python -m expframe.plan --gin_file=quickstart --hardware=cpu --devices=1,2,4,8 --out=plan.json
    python -m expframe.plan.anchors      # the device model against published ResNet-50 measurements
    python -m expframe.plan.input_table  # the host cores that feed each device (the input bound)

The experiment is built from its gin files on this CPU (one replica, float32, nothing
trained) and its train step traced: FLOPs, parameter, gradient, slot and activation
bytes are measured (expframe/plan/measure.py). The device comes from the catalogue
(expframe/plan/hardware.json, each value with its published source), from a datasheet
file (--hardware=FILE.json, expframe/plan/datasheet.py) or, for `cpu`, is measured
here. The model (expframe/plan/model.py): step = compute + HBM traffic + the
step's collectives (every update's all-reduce, every SyncBatchNorm all-reduce) + input +
host, no overlap; the device model's parameters are shared by every device of a kind
and fitted to published measurements (expframe/plan/anchors.py; checked by
expframe/plan/validation.py). Input is what the host's CPU takes beyond the device step:
for an ImageNet classification experiment it is predicted from a measured per-core rate
(expframe/plan/input_rate.json, x --host_core_factor) and the reference host's cores
(hardware.json host_cpu; expframe/plan/input_bound.py); where it is longer than the device
step the bottleneck is `input` and the notes count the cores data-service workers would
have to add. Prints one table, writes JSON with --out.

Exit status: 0 with the table (also when a configuration does not fit in memory: the
table names the shortfall); 2 for bad input (one line on stderr).
"""

import argparse
import os
import sys
from typing import List, Optional

PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage first)
        print(f"error: {message}; see `python -m expframe.plan --help`.", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m expframe.plan", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--gin_file", action="append", required=True, help="the experiment (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="a gin binding (repeatable)")
    p.add_argument("--hardware", required=True, help="a catalogue device (v2, v3, v4, v5e, v5p, p100, v100 (16 GB), "
                   "v100_32gb, a100 (80 GB), a100_40gb, h100, h200), cpu (this machine, measured), or FILE.json: a "
                   "device described by its datasheet (expframe/plan/datasheet.py), planned with the shared "
                   "parameters alone; rows count chips or GPUs, a TPU v2/v3 chip being 2 replicas")
    p.add_argument("--devices", required=True, help="comma-separated device counts, e.g. 8,32,256")
    p.add_argument("--global_batch_size", type=int, help="examples per step (default: the experiment's)")
    p.add_argument("--utilisation", type=float, help="achieved / peak FLOP/s of the compute roof (default: fitted "
                   "per math unit to published measurements, expframe/plan/anchors.json; cpu: 1.0 of the probe)")
    p.add_argument("--precision", choices=PRECISIONS, help="Keras policy (default: the experiment's; 'auto' "
                   "-> bfloat16 on TPU, 16-bit on GPU, float32 on CPU)")
    p.add_argument("--devices_per_host", type=int, help="devices sharing a host and its network (default: catalogue)")
    p.add_argument("--inter_host_gbps", type=float, help="network between hosts, Gbit/s per host (default: catalogue)")
    p.add_argument("--latency_us", type=float, help="latency of one step of a collective, microseconds")
    p.add_argument("--input_us_per_example", type=float, help="host input time per example, microseconds over "
                   "the host's cores, used as given (0: the input keeps up). Default: predicted for an ImageNet "
                   "classification experiment (imagenet_input, real data) on a device whose host CPU is known, from "
                   "the measured per-core rate (expframe/plan/input_rate.json) and the host's cores; elsewhere "
                   "assumed to keep up")
    p.add_argument("--host_core_factor", type=float, default=1.0, help="one core of the planned host against the "
                   "core the input rate was measured on (input_rate.json 'cpu'): 2 = twice its speed (default 1.0)")
    p.add_argument("--host_cores_per_device", type=float, help="CPU cores (physical) of the host per device, the "
                   "cores that preprocess the input (default: the catalogue's reference host, hardware.json "
                   "host_cpu, e.g. 14 per GPU of a DGX H100)")
    p.add_argument("--host_ms", type=float, default=0.0, help="host overhead per host call of steps_per_loop steps")
    p.add_argument("--actors", type=int, help="D4PG: actor processes (default: the experiment's, at least 1)")
    p.add_argument("--actor_steps_per_s", type=float, help="D4PG: one actor's environment steps/s (default: measured)")
    p.add_argument("--cpu_flops", type=float, help="cpu only: this machine's FLOP/s (default: measured by the probe)")
    p.add_argument("--out", help="write the plan as JSON here")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown (as the docs hold it)")
    return p


def _devices(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--devices={text!r}: give positive device counts separated by commas, e.g. 8,32,256")
    return values


def check(args: argparse.Namespace) -> Optional[str]:
    """The first problem with the flags (one line), or None; imports no TensorFlow."""
    from expframe import gin_paths  # pylint: disable=import-outside-toplevel
    from expframe.errors import ConfigError  # pylint: disable=import-outside-toplevel
    from expframe.plan import catalogue, datasheet  # pylint: disable=import-outside-toplevel
    try:
        args.devices = _devices(args.devices)
    except ValueError as e:
        return str(e)
    if args.hardware.lower() != "cpu":
        try:
            (datasheet.load if datasheet.is_datasheet(args.hardware) else catalogue.published)(args.hardware)
        except ConfigError as e:
            return str(e)
    positive = {"--global_batch_size": args.global_batch_size, "--devices_per_host": args.devices_per_host,
                "--inter_host_gbps": args.inter_host_gbps, "--actors": args.actors,
                "--actor_steps_per_s": args.actor_steps_per_s, "--cpu_flops": args.cpu_flops,
                "--host_core_factor": args.host_core_factor, "--host_cores_per_device": args.host_cores_per_device}
    for flag, value in positive.items():
        if value is not None and not value > 0:
            return f"{flag}={value}: must be > 0"
    for flag, value in {"--latency_us": args.latency_us, "--input_us_per_example": args.input_us_per_example,
                        "--host_ms": args.host_ms}.items():
        if value is not None and value < 0:
            return f"{flag}={value}: must be >= 0"
    if args.utilisation is not None and not 0 < args.utilisation <= 1:
        return f"--utilisation={args.utilisation}: must be in (0, 1] (achieved over peak FLOP/s)"
    if args.input_us_per_example is None:
        from expframe.plan import input_rate  # pylint: disable=import-outside-toplevel
        try:
            input_rate.load()  # a malformed rate file: one line before TensorFlow starts
        except ConfigError as e:
            return str(e)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        return f"--out={args.out}: its folder does not exist"
    try:
        args.gin_file = [gin_paths.resolve(f) for f in args.gin_file]
    except ConfigError as e:
        return str(e)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    problem = check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from expframe import tf_noise  # pylint: disable=import-outside-toplevel
    from expframe.errors import ConfigError  # pylint: disable=import-outside-toplevel
    try:
        with tf_noise.quiet_start(enabled=True):
            from expframe.plan import measure, planner, table  # pylint: disable=import-outside-toplevel
        settings = measure.experiment_settings(args.gin_file, args.gin_param)
        hw = planner.hardware(args.hardware, args.devices_per_host, args.inter_host_gbps, args.latency_us,
                              args.cpu_flops, args.host_cores_per_device)
        fp, details = measure.footprint(args.gin_file, args.gin_param, settings)
        if hw.kind == "cpu" and fp.sync_collectives:
            hw = planner.with_sync_probe(hw, args.devices)
        plan = planner.make_plan(fp, details, settings, hw, args.devices, args.global_batch_size, args.utilisation,
                                 args.precision, args.input_us_per_example, args.host_ms, args.actors,
                                 args.actor_steps_per_s, args.host_core_factor)
    except ConfigError as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print(table.format_markdown(plan["rows"]) if args.markdown else table.format_table(plan["rows"]))
    print("\n".join(table.notes(plan)))
    if args.out:
        table.write_json(plan, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
