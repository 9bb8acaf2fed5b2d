"""A run continues on another replica count (issue 9, item 3), through main.py.

The quickstart, shrunk, runs 8 steps on 2 replicas with a checkpoint at step 4. Two
copies of its model_dir are cut back to that checkpoint, as if the run had been
killed after step 5, and resume on 4 and on 1 replica with --allow_config_change.
Each must continue from step 4 with the data position carried over (index-based:
the input restarts at global example 4 x 16 = 64), so that steps 5-8 see the same
global batches as the run that never stopped: the same losses at every step and the
same final weights, to float32 rounding (sync batch norm and the gradient mean make
the maths independent of the replica count). A resumed run that re-read or skipped
examples would differ.
"""

import glob
import os
import shutil

import numpy as np
import tensorflow as tf

from tests import main_runner as mr

QUICKSTART = "experiments/quickstart.gin"
# SMALL checkpoints every 4 steps.
PARAMS = mr.SMALL + ("run_experiment.deterministic = True", "Trainer.log_every_steps = 1",
                     "Trainer.steps_per_loop = 1", "Trainer.train_steps = 8")


def _weights(model_dir):
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    names = sorted(n for n in reader.get_variable_to_shape_map() if n.startswith("model/"))
    assert names, "no model variables in the checkpoint"
    return {n: reader.get_tensor(n) for n in names}


def _back_to_step_4(model_dir):
    """Leaves only the step-4 checkpoint, as after a crash at step 5."""
    checkpoints = os.path.join(model_dir, "checkpoints")
    for path in glob.glob(os.path.join(checkpoints, "ckpt-8.*")):
        os.remove(path)
    step4 = os.path.join(checkpoints, "ckpt-4")
    tf.compat.v1.train.update_checkpoint_state(checkpoints, step4, [step4])
    os.remove(os.path.join(model_dir, "result.json"))


def test_a_2_replica_run_continues_on_4_and_on_1(data_dir, tmp_path):
    straight = tmp_path / "straight"
    done = mr.run([QUICKSTART], straight, data_dir, PARAMS + ("Replicator.num_replicas = 2",), ["--mode=train"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed = {}
    for n in (4, 1):
        shutil.copytree(straight, tmp_path / f"on{n}")
        _back_to_step_4(tmp_path / f"on{n}")
        resumed[n] = mr.start([QUICKSTART], tmp_path / f"on{n}", data_dir, PARAMS + (f"Replicator.num_replicas = {n}",),
                              ["--mode=train", "--allow_config_change"])
    for proc in resumed.values():
        proc.output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, proc.output[-4000:]

    reference = mr.metrics(straight, "train")
    assert [r["step"] for r in reference] == list(range(1, 9))
    assert len({round(r["loss"], 5) for r in reference}) > 1, "losses did not change: nothing was trained"
    for n, proc in resumed.items():
        assert "resuming from step 4" in proc.output, proc.output[-3000:]
        assert (f"data position carried over: 4 global batches, 64 examples consumed (counted on 2 replicas, "
                f"continuing on {n}); the input restarts at global example 64") in proc.output, proc.output[-3000:]
        assert f"target 'cpu', {n} replica(s)" in proc.output
        rows = mr.metrics(tmp_path / f"on{n}", "train")
        assert [r["step"] for r in rows] == list(range(1, 9)), n
        np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in reference], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{n} replicas")
        a, b = _weights(straight), _weights(tmp_path / f"on{n}")
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=f"{n} replicas: {name}")
        # The data position is three numbers in the checkpoint; no per-worker files.
        reader = tf.train.load_checkpoint(os.path.join(tmp_path / f"on{n}", "checkpoints"))
        position = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k.startswith("data/")}
        assert position == {"data/batches/.ATTRIBUTES/VARIABLE_VALUE": 8,
                            "data/examples/.ATTRIBUTES/VARIABLE_VALUE": 128,
                            "data/replicas/.ATTRIBUTES/VARIABLE_VALUE": n}, position
        assert not (tmp_path / f"on{n}" / "checkpoints" / "data").exists()
