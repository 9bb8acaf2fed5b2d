"""The cost of recovery: from a fault to the first train step after the restart, in phases.

    python benchmarks/recovery.py            # ~8 minutes on 2 idle cores (~920 CPU-seconds)
    python benchmarks/recovery.py --quick    # ~5 minutes (~560 CPU-seconds): one fault per workload

`python -m expframe.launch --workers=2 --max_restarts=N` runs main.py
(Replicator.target='multi_worker', one step per host call, a checkpoint every
`--checkpoint_every` steps) on two workloads:

  quickstart  experiments/quickstart.gin as shipped (ResNet-8, global batch 120) on a
              512-image build of its shapes dataset
  resnet50    experiments/resnet50_imagenet_fake.gin (ResNet-50, mock ImageNet JPEGs)
              shrunk to 64x64 pixels and a global batch of 4

and injects faults, one per start of the cluster, each after the chief logged a step:
SIGKILL of worker 1, SIGKILL of worker 0 (the chief), SIGSTOP of worker 1 (a hang,
found by the coordination service's heartbeats: `--heartbeat_timeout_s`, 5 s); on
ResNet-50, whose every start traces for minutes, the first and the last (`--quick`:
the first on each). Each line of the cluster's output is timestamped as it arrives;
the phases of a recovery:

  detection  fault -> the launcher sees a process fail (its restart line says how long
             before it printed that the failure was seen)
  restart    -> the restarted chief starts restoring: stopping the survivors (SIGTERM,
             then SIGKILL after --grace_s; a stopped process at once), new processes,
             TensorFlow's import, the cluster's formation, building the model and input
  restore    the checkpoint's restore (main.py's `resuming from step N (...; restored in T s)`),
             agreeing on the step with the other worker included
  re-trace   -> the first step after the restart is logged, less one step's time (the
             median step of the start before): tracing the train step again
  total      fault -> that first step

Steps lost per fault: the last step logged before the fault minus the step resumed from.
Results: a table on stdout and JSON in `benchmarks/results/recovery[_quick].json`, with
the CPU and the load average at start and end (compare phases within one run).
"""

import argparse
import json
import os
import queue
import re
import signal
import statistics
import sys
import tempfile
import time

from expframe import processes  # noqa: E402
from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
FAULTS = {"kill_worker_1": ("worker 1", signal.SIGKILL), "kill_chief": ("worker 0", signal.SIGKILL),
          "hang_worker_1": ("worker 1", signal.SIGSTOP)}
FULL = {"quickstart": list(FAULTS), "resnet50": ["kill_worker_1", "hang_worker_1"]}
MULTI_WORKER = ["Replicator.target = 'multi_worker'", "Replicator.num_replicas = None", "Trainer.steps_per_loop = 1",
                "Trainer.log_every_steps = 1", "Trainer.eval_every_steps = None", "Trainer.train_steps = 100000"]
WORKLOADS = {
    "quickstart": ("experiments/quickstart.gin",
                   ["shapes_input.num_train = 512", "shapes_input.num_test = 64"]),
    "resnet50": ("experiments/resnet50_imagenet_fake.gin",
                 ["resnet.input_shape = (64, 64, 3)", "imagenet_input.image_size = 64",
                  "Trainer.global_batch_size = 4", "WarmupSchedule.steps_per_epoch = 16"]),
}
_RESTART = re.compile(r"expframe.launch: restart \d+/\d+: (.*?); resumed from step (\d+).*?, "
                      r"(\d+\.\d\d) s after the failure")
_RESUMING = re.compile(r"^\[worker 0\] resuming from step (\d+) \(.*; restored in (\d+\.\d\d) s\)")
_STEP = re.compile(r"^\[worker 0\] step (\d+)/")


class Run:
    """The launcher and its cluster, with every output line timestamped on arrival."""

    def __init__(self, command, env, log_path):
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115  (closed in stop)
        self.lines = []  # (time, line)
        self._arrived = queue.Queue()  # (time of arrival, line), from the owner's reader thread
        # The launcher in a session of its own (expframe.processes): stopped, with the
        # cluster it started, however this script ends.
        self.child = processes.owner().start(
            command, "launcher", cwd=ROOT, env=env,
            on_line=lambda child, raw: self._arrived.put((time.monotonic(), raw.decode("utf-8", errors="replace"))))
        self.proc = self.child.popen

    def read_until(self, pattern, timeout=900.0):
        """Reads lines until one matches; returns (time, match)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                now, line = self._arrived.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and not (self.child.reader and self.child.reader.is_alive()):
                    break
                continue
            self.lines.append((now, line))
            self.log.write(f"{now:.3f} {line}")
            m = pattern.search(line)
            if m:
                return now, m
        self.log.flush()
        raise RuntimeError(f"{pattern.pattern!r} never appeared; see {self.log.name}")

    def pid_of(self, task):
        """The pid of the launcher's child whose TF_CONFIG task is `task` ("worker 1")."""
        kind, index = task.split()
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) != self.proc.pid:
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except (OSError, ValueError, IndexError):
                continue
            config = json.loads(env.get(b"TF_CONFIG", b"{}"))
            if config.get("task") == {"type": kind, "index": int(index)}:
                return int(entry)
        raise RuntimeError(f"no {task} among the launcher's children")

    def stop(self):
        """SIGTERM to the launcher (it stops its cluster), SIGKILL to what is left after 60 s."""
        processes.owner().stop([self.child], signal.SIGTERM, grace_s=60.0)
        self.log.close()


def step_time(lines, since):
    """Median time between consecutive step lines of the chief after `since`."""
    times = [t for t, line in lines if t > since and _STEP.match(line)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps[1:] or gaps or [0.0])


def measure(workload, faults, tmp, every, steps_between):
    gin_file, params = WORKLOADS[workload]
    model_dir = os.path.join(tmp, workload)
    command = [sys.executable, "-m", "expframe.launch", "--workers=2", f"--max_restarts={len(faults)}",
               "--grace_s=3", "--heartbeat_timeout_s=5", "--", "main.py", f"--gin_file={gin_file}",
               f"--model_dir={model_dir}", "--mode=train"]
    command += [f"--gin_param={p}" for p in MULTI_WORKER + params + [f"Trainer.checkpoint_every_steps = {every}"]]
    env = dict(os.environ, TFDS_DATA_DIR=os.path.join(tmp, "tfds"), PYTHONUNBUFFERED="1")
    run = Run(command, env, os.path.join(tmp, f"{workload}.log"))
    rows = []
    try:
        start, _ = run.read_until(re.compile(r"^\[worker 0\] model_dir "))
        resumed_step = 0
        for name in faults:
            task, sig = FAULTS[name]
            # a few steps of this start of the cluster: one past a checkpoint, so every fault loses steps
            target = (resumed_step // every + 1) * every + steps_between
            run.read_until(re.compile(rf"^\[worker 0\] step {target}/"))
            step_s = step_time(run.lines, start)
            last = max(int(_STEP.match(line).group(1)) for t, line in run.lines if t > start and _STEP.match(line))
            pid = run.pid_of(task)
            faulted = time.monotonic()
            os.kill(pid, sig)  # a stopped worker is killed by the launcher
            t_line, m = run.read_until(_RESTART)
            t_resuming, r = next((t, _RESUMING.match(line)) for t, line in run.lines
                                 if t > faulted and _RESUMING.match(line))
            seen = t_line - float(m.group(3))
            restore_s = float(r.group(2))
            t_first, _ = run.read_until(re.compile(rf"^\[worker 0\] step {int(r.group(1)) + 1}/"))
            start = t_resuming
            resumed_step = int(m.group(2))
            rows.append({
                "workload": workload, "fault": name, "failure": m.group(1), "step_s": round(step_s, 3),
                "steps_lost": last - resumed_step, "resumed_from": resumed_step,
                "detection_s": round(seen - faulted, 2),
                "restart_s": round(t_resuming - restore_s - seen, 2),
                "restore_s": round(restore_s, 2),
                "retrace_s": round(max(t_first - t_resuming - step_s, 0.0), 2),
                "total_s": round(t_first - faulted, 2)})
            print(_row(rows[-1]), flush=True)
    finally:
        run.stop()
    return rows


HEADER = (f"{'workload':<11} {'fault':<14} {'detection':>9} {'restart':>8} {'restore':>8} {'re-trace':>8} "
          f"{'total':>7} {'step':>6} {'lost':>5}")


def _row(r):
    return (f"{r['workload']:<11} {r['fault']:<14} {r['detection_s']:>8.2f}s {r['restart_s']:>7.2f}s "
            f"{r['restore_s']:>7.2f}s {r['retrace_s']:>7.2f}s {r['total_s']:>6.2f}s {r['step_s']:>5.2f}s "
            f"{r['steps_lost']:>5}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one fault per workload (SIGKILL of worker 1)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--checkpoint_every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or os.path.join(RESULTS, f"recovery{'_quick' if args.quick else ''}.json")
    result = {"benchmark": "recovery", "cpu": cpu_name(), "cores": os.cpu_count(), "quick": args.quick,
              "load_average_at_start": round(os.getloadavg()[0], 2), "checkpoint_every_steps": args.checkpoint_every,
              "rows": []}
    print(f"{cpu_name()}, {os.cpu_count()} cores; 2 workers on 127.0.0.1; "
          f"load average {result['load_average_at_start']}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="expframe_recovery_") as tmp:
        # The shapes data once, before anything is timed (two workers must not generate it at once).
        processes.run([sys.executable, "-c", "import sys; from expframe.data import shapes\n"
                       "for s in ('train', 'test'): shapes.load_shapes(s, size=32, data_dir=sys.argv[1], "
                       "num_train=512, num_test=64)", os.path.join(tmp, "tfds")], "shapes data", cwd=ROOT,
                      check=True, env=dict(os.environ, PYTHONPATH=ROOT))
        print(HEADER, flush=True)
        for workload in args.workloads:
            faults = ["kill_worker_1"] if args.quick else FULL[workload]
            result["rows"] += measure(workload, faults, tmp, args.checkpoint_every, steps_between=2)
    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_time_s"] = round(time.monotonic() - started, 1)
    print(f"load average at the end {result['load_average_at_end']}; {result['wall_time_s']:.0f} s in all")
    write_result(out, result)


if __name__ == "__main__":
    main()
