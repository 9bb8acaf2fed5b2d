"""The quickstart as shipped learns: eval top-1 >= 0.90 (minutes; `python -m pytest -m slow`).

The experiment and its threshold are `expframe.reproduce.registry.QUICKSTART`, which
`python -m expframe.reproduce --set=learning` runs for docs/results.md."""

import json
import time

import pytest

from expframe.reproduce import registry
from tests import main_runner as mr

QUICKSTART = registry.get("quickstart")


@pytest.mark.slow
def test_quickstart_reaches_090_top1(tmp_path):
    started = time.time()
    done = mr.run(QUICKSTART.gin_files, tmp_path / "run", tmp_path / "tfds", QUICKSTART.params(), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    print(f"quickstart: top1 {result['eval']['top1']:.4f} in {time.time() - started:.0f} s "
          f"(training {result['wall_time_s']:.0f} s)")
    assert QUICKSTART.passed(result["eval"]), [t.text() for t in QUICKSTART.thresholds]
