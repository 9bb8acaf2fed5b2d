"""The layers of expframe (issue 31, item 4): the import-linter contracts declared in
pyproject.toml hold, as `.ci/run` checks with `lint-imports`; here the default test
suite checks it too, so a new arrow up the layers (or a new circle) fails a test run."""

import os

from importlinter import cli

from tests import main_runner as mr


def test_the_import_contracts_hold(capsys, monkeypatch):
    monkeypatch.chdir(mr.ROOT)
    code = cli.lint_imports(config_filename=os.path.join(mr.ROOT, "pyproject.toml"), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert "Layers: arrows only run down KEPT" in out and "No import circles" in out, out[-4000:]
