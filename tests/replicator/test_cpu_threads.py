"""Threads for logical CPU replicas: one thread per op once the replicas fill the cores
(expframe/replicator/targets.py, intra_op_threads; benchmarks/cpu_replicas.py)."""

import os
import subprocess
import sys

import pytest

from expframe.replicator import targets
from tests import main_runner as mr


@pytest.mark.parametrize("replicas, cores, environ, current, expected", [
    (8, 2, {}, 0, 1),                                  # the replicas fill the cores: one thread per op
    (2, 2, {}, 0, 1),
    (1, 2, {}, 0, None),                               # one replica keeps TensorFlow's pool
    (4, 16, {}, 0, None),                              # fewer replicas than cores: ops may spread
    (0, 2, {}, 0, None),                               # an explicit split_cpu says nothing of replicas
    (8, 2, {"TF_NUM_INTRAOP_THREADS": "2"}, 0, None),  # the user's (or the sweep's) setting stays
    (8, 2, {}, 3, None),
])
def test_intra_op_threads(replicas, cores, environ, current, expected):
    assert targets.intra_op_threads(replicas, cores, environ, current) == expected


def test_a_replicator_that_fills_the_cores_runs_one_thread_per_op():
    cores = len(os.sched_getaffinity(0))
    if cores > 16:
        pytest.skip("more cores than the replicas worth splitting into here")
    code = ("import sys, expframe, tensorflow as tf; expframe.Replicator('cpu', int(sys.argv[1])); "
            "print('THREADS', tf.config.threading.get_intra_op_parallelism_threads(), "
            "tf.config.threading.get_inter_op_parallelism_threads())")
    env = {k: v for k, v in mr.env(".").items() if k not in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
                                                             "EXPFRAME_CPU_DEVICES")}
    done = subprocess.run([sys.executable, "-c", code, str(cores)], cwd=mr.ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    line, = [line for line in done.stdout.splitlines() if line.startswith("THREADS")]
    assert line == f"THREADS 1 {max(cores, 2 * max(cores, 8))}", done.stderr[-2000:]
