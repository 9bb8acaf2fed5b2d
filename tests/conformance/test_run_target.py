"""`matrix.run_target`, the GPU check's entry point (benchmarks/gpu_check.py), on the
CPU target: its rows carry the matrix's verdict and the agreement measured against
the float32 run on one CPU replica. It runs in its own process, as the GPU check
calls it (a run sets process-wide state: the Keras dtype policy, logical devices)."""

import json
import os
import re
import subprocess
import sys

from tests.conformance import matrix

CODE = ("import json; from tests.conformance import matrix; "
        "print('ROWS ' + json.dumps(matrix.run_target('cpu', families=('d4pg',), precisions=('mixed_float16',))))")


def test_run_target_compares_a_precision_with_float32_on_one_cpu_replica():
    env = dict(os.environ, PYTHONPATH=matrix.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", CODE], cwd=matrix.ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads([line for line in done.stdout.splitlines() if line.startswith("ROWS ")][-1][5:])
    assert [r["combination"] for r in rows] == ["d4pg | cpu x1 | mixed_float16"]
    assert rows[0]["result"] == "matches", rows
    cosine, ratio = map(float, re.search(r"update cosine ([\d.]+), norm ratio ([\d.]+)", rows[0]["agreement"]).groups())
    assert cosine > matrix.MIXED_MIN_COSINE["mixed_float16"] and abs(ratio - 1) <= matrix.MIXED_NORM_TOLERANCE, rows
