"""Forgetting `scale_loss` cannot pass silently (issue 18, item 2): a user's task that
hands gradients of the unscaled loss to its wrapped optimizer under mixed_float16 is
refused through main.py while its step is traced: one line naming the task's step and
the fix, exit 2, nothing written into the model_dir."""

from tests import main_runner as mr

GIN = """
import tests.conformance.forgetful_task
include 'experiments/quickstart.gin'
run_experiment.task = @ForgetfulTask()
ForgetfulTask.model = @resnet
ForgetfulTask.dataset = @shapes_input
ForgetfulTask.optimizer = @keras.optimizers.Adam
"""


def test_a_task_that_forgets_scale_loss_is_refused_under_mixed_float16(data_dir, tmp_path):
    gin_file = tmp_path / "forgetful.gin"
    gin_file.write_text(GIN)
    model_dir = tmp_path / "run"
    done = mr.run([str(gin_file)], model_dir, data_dir,
                  mr.SMALL + ("Trainer.global_batch_size = 4", "run_experiment.precision = 'mixed_float16'"),
                  extra=["--mode=train"])
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith("error: ForgetfulTask.train_step (tests/conformance/forgetful_task.py) passed "
                                "gradients of an unscaled loss to apply_gradients"), errors[0]
    assert "loss scaling is on" in errors[0] and "`optimizer.minimize(loss, variables, tape)`" in errors[0]
    assert not model_dir.exists()  # refused while tracing, before anything was written
