"""The cpu target's inter-op pool (issue 61): sized by the replicas that run, plus what a
task's host-side services reserve, not by the 8 logical devices split for later use.

16 threads on a 2-core CPU for every run, one replica included, cost a run through
main.py 6-9 % against Keras fit in its own process (expframe/replicator/targets.py)."""

import json
import os
import subprocess
import sys

from expframe.replicator.targets import inter_op_threads
from expframe.rl.rpc import MAX_HELD_INSERTS
from tests.tasks.test_d4pg import _task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A fresh process: the pool is fixed when TensorFlow starts, once per process.
_PROBE = """
import json, os, sys
import tensorflow as tf
import expframe
from expframe.replicator import reserve_inter_op_threads
reserve_inter_op_threads(int(sys.argv[2]))
replicator = expframe.Replicator("cpu", int(sys.argv[1]))
print(json.dumps({"pool": tf.config.threading.get_inter_op_parallelism_threads(),
                  "devices": len(tf.config.list_logical_devices("CPU")),
                  "replicas": replicator.num_replicas, "cores": os.cpu_count()}))
"""


def test_the_rule():
    assert [inter_op_threads(n, 2) for n in (1, 2, 3, 8)] == [2, 4, 6, 16]
    assert inter_op_threads(1, 64) == 64 and inter_op_threads(8, 64) == 64
    assert inter_op_threads(1, 2, reserved=MAX_HELD_INSERTS + 2) == 12


def test_a_fresh_process_gets_the_pool_of_its_replicas_and_reservation():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("EXPFRAME_CPU_DEVICES", None)
    cases = {(1, 0): None, (2, 10): None}
    procs = {case: subprocess.Popen([sys.executable, "-c", _PROBE, str(case[0]), str(case[1])], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case in cases}
    for (replicas, reserved), proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        found = json.loads(stdout.strip().splitlines()[-1])
        # Still 8 logical devices, so that larger Replicators can follow in the process.
        assert found["devices"] == 8 and found["replicas"] == replicas, found
        assert found["pool"] == max(found["cores"], 2 * replicas + reserved), found


def test_d4pg_reserves_threads_for_its_actor_service_only_with_actors():
    assert _task().host_threads == 0
    assert _task(num_actors=3).host_threads == MAX_HELD_INSERTS + 3
