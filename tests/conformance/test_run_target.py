"""`matrix.run_target`, the GPU check's entry point (benchmarks/gpu_check.py), on the
CPU target: its rows carry the matrix's verdict and the agreement measured against
the float32 run on one CPU replica."""

import re

from tests.conformance import matrix


def test_run_target_compares_a_precision_with_float32_on_one_cpu_replica():
    rows = matrix.run_target("cpu", families=("d4pg",), precisions=("mixed_float16",))
    assert [r["combination"] for r in rows] == ["d4pg | cpu x1 | mixed_float16"]
    assert rows[0]["result"] == "matches", rows
    cosine, ratio = map(float, re.search(r"update cosine ([\d.]+), norm ratio ([\d.]+)", rows[0]["agreement"]).groups())
    assert cosine > matrix.MIXED_MIN_COSINE["mixed_float16"] and abs(ratio - 1) <= matrix.MIXED_NORM_TOLERANCE, rows
