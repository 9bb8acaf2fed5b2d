"""The cpu target's inter-op pool (issue 61): sized by the replicas that run, plus what a
task's host-side services reserve, not by the 8 logical devices split for later use.

16 threads on a 2-core CPU for every run, one replica included, cost a run through
main.py 6-9 % against Keras fit in its own process (expframe/replicator/targets.py)."""

import json
import os
import subprocess
import sys

import gin

from expframe import experiment
from expframe.replicator.targets import inter_op_threads
from expframe.rl.rpc import MAX_HELD_INSERTS
from tests.tasks.test_d4pg import _task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A fresh process: the pool is fixed when TensorFlow starts, once per process.
_PROBE = """
import json, os, sys
import tensorflow as tf
import expframe
from expframe.replicator import reserve_inter_op_threads, split_only_for
reserve_inter_op_threads(int(sys.argv[2]))
if int(sys.argv[3]):
    split_only_for(int(sys.argv[3]))
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
    # (replicas, reserved threads, split_only_for) -> logical devices: 8 unless the process
    # says it builds no larger Replicator (run_experiment), so that larger ones can follow.
    cases = {(1, 0, 0): 8, (2, 10, 0): 8, (1, 0, 1): 1}
    procs = {case: subprocess.Popen([sys.executable, "-c", _PROBE] + [str(c) for c in case], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case in cases}
    for (replicas, reserved, _), proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        found = json.loads(stdout.strip().splitlines()[-1])
        assert found["devices"] == cases[(replicas, reserved, _)] and found["replicas"] == replicas, found
        assert found["pool"] == max(found["cores"], 2 * replicas + reserved), found


def test_run_experiment_splits_only_the_bound_replicas_of_a_cpu_target(monkeypatch):
    devices, reserved = [], []
    monkeypatch.setattr(experiment, "split_only_for", devices.append)
    monkeypatch.setattr(experiment, "reserve_inter_op_threads", reserved.append)
    for bindings in ("Replicator.num_replicas = 3", "Replicator.target = 'cpu'", "Replicator.target = 'gpu'"):
        gin.clear_config()
        gin.parse_config(bindings)
        experiment._size_the_cpu(_task(num_actors=2))  # pylint: disable=protected-access
    gin.clear_config()
    assert devices == [3, 1] and reserved == [MAX_HELD_INSERTS + 2] * 3


def test_d4pg_reserves_threads_for_its_actor_service_only_with_actors():
    assert _task().host_threads == 0
    assert _task(num_actors=3).host_threads == MAX_HELD_INSERTS + 3
