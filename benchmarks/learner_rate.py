"""A D4PG learner's updates/s as its own `main.py` run measures them: the task's
`learner_steps_per_sec` (host calls of train steps only: acting and the first call, which
traces, excluded) in the last train record. Shared by the D4PG benchmarks."""

import json
import os
import sys

from expframe import processes  # noqa: E402
from machine import ROOT  # noqa: E402  (benchmarks/machine.py)


def learner_steps_per_sec(gin_file: str, params, model_dir: str) -> float:
    """Runs `main.py --mode=train` (no final eval) on `gin_file` with `params` (gin bindings)
    into `model_dir`, in a session of its own that stops with the caller; SystemExit with
    its output's tail if it fails."""
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), f"--gin_file={gin_file}", f"--model_dir={model_dir}",
           "--mode=train"] + [f"--gin_param={p}" for p in params]
    done = processes.run(cmd, "learner", cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"learner run failed ({gin_file}, {list(params)}):\n{done.stdout[-3000:]}")
    with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if '"train"' in line]
    return float(rows[-1]["learner_steps_per_sec"])
