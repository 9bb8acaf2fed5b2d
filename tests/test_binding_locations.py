"""A configuration error that names a binding says where it was bound (issue 51, item 5):
the file and line of the binding gin applied (an include's, or the including file's
later one), or the --gin_param; through main.py in tests/test_main.py's BAD_INPUTS."""

import gin
import pytest

from expframe import config, gin_errors
from expframe.errors import ConfigError
from expframe.trainer import Trainer


def _error_of(make) -> str:
    with pytest.raises(ConfigError) as raised:
        make()
    return gin_errors.located(str(raised.value).splitlines()[0])


def test_a_wrong_type_names_the_file_and_line_of_its_binding(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "steps.gin").write_text("# the run's length\nTrainer.train_steps = 1e3\nTrainer.log_every_steps = 0\n")
    main = tmp_path / "main.gin"
    main.write_text("Trainer.global_batch_size = 8\ninclude 'steps.gin'\n\nTrainer.log_every_steps = 5.0\n")
    try:
        config.parse([str(main)], [])
        message = _error_of(lambda: Trainer())  # pylint: disable=unnecessary-lambda
        assert message == (f"{tmp_path / 'steps.gin'}:2: Trainer.train_steps=1000.0 must be a positive integer or "
                           "None (write 1000: gin reads 1e3 or 1000.0 as a float).")
        # The including file's later binding is the one gin applies, and the one named.
        config.parse([str(main)], ["Trainer.train_steps = 10"])
        assert _error_of(lambda: Trainer()).startswith(  # pylint: disable=unnecessary-lambda
            f"{main}:4: Trainer.log_every_steps=5.0 must be a positive integer")
        # A --gin_param binding is named as given.
        config.parse([str(main)], ["Trainer.train_steps = 10", "Trainer.log_every_steps = -1"])
        assert _error_of(lambda: Trainer()) == (  # pylint: disable=unnecessary-lambda
            "--gin_param='Trainer.log_every_steps = -1': Trainer.log_every_steps=-1 must be a positive integer.")
    finally:
        gin.clear_config()


def test_located_leaves_other_lines_alone():
    gin_errors.forget_bindings()
    gin_errors.record_binding("", "expframe.trainer.Trainer", "train_steps", "x.gin:3")
    gin_errors.record_binding("eval", "Trainer", "eval_steps", "x.gin:4")
    assert gin_errors.located("Trainer.train_steps=0 must be ...") == "x.gin:3: Trainer.train_steps=0 must be ..."
    assert gin_errors.located("eval/Trainer.eval_steps=0 must be") == "x.gin:4: eval/Trainer.eval_steps=0 must be"
    assert gin_errors.located("Trainer.eval_steps=0 must be") == "Trainer.eval_steps=0 must be"  # another scope
    assert gin_errors.located("loss is nan at step 3") == "loss is nan at step 3"
    gin_errors.forget_bindings()
    assert gin_errors.located("Trainer.train_steps=0 must be ...") == "Trainer.train_steps=0 must be ..."
