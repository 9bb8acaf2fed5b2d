"""Logical CPU devices have a ceiling (issue 18, item 9): asking main.py for more than 64
is a configuration error within seconds, not a process that grows for minutes.

`Replicator.mesh_shape = {'batch': 64, 'model': 64}` on a CPU used to ask TensorFlow
for 4,096 logical devices (11 GB and 16,000 threads after 5 minutes, no step); a
large `Replicator.num_replicas` likewise. Both runs start at once to share the wait."""

import subprocess

from tests import main_runner as mr

CASES = {
    "num_replicas": (["experiments/quickstart.gin"],
                     # 130 divides by 65 replicas: without the ceiling this would try to train.
                     ("Replicator.num_replicas = 65", "Trainer.global_batch_size = 130", "Trainer.train_steps = 1"),
                     "Replicator.num_replicas=65 on target 'cpu' asks for 65 logical CPU devices, more than the "
                     "ceiling of 64"),
    "mesh_shape": (["experiments/vit_shapes_mesh.gin"], ("Replicator.mesh_shape = {'batch': 64, 'model': 64}",),
                   "Replicator.mesh_shape={'batch': 64, 'model': 64} asks for 4096 logical CPU devices, more than "
                   "the ceiling of 64"),
}


def test_more_logical_cpu_devices_than_the_ceiling_exit_2_at_once(data_dir, tmp_path):
    procs = {name: subprocess.Popen(mr.args(files, tmp_path / name, params), cwd=mr.ROOT, env=mr.env(data_dir),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (files, params, _) in CASES.items()}
    try:
        # Import and gin parsing only; the unbounded split took minutes and never ended.
        outputs = {name: proc.communicate(timeout=180) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (_, _, message) in CASES.items():
        stdout, stderr = outputs[name]
        assert procs[name].returncode == 2, (name, stdout[-2000:], stderr[-2000:])
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in stderr, (name, stderr[-2000:])
        assert message in errors[0] and "EXPFRAME_CPU_DEVICES=" in errors[0], errors[0]
        assert not (tmp_path / name).exists()  # nothing written
