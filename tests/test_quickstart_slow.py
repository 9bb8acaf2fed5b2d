"""The quickstart as shipped learns: eval top-1 >= 0.90 (minutes; `python -m pytest -m slow`)."""

import json
import time

import pytest

from tests import main_runner as mr


@pytest.mark.slow
def test_quickstart_reaches_090_top1(tmp_path):
    started = time.time()
    done = mr.run(["experiments/quickstart.gin"], tmp_path / "run", tmp_path / "tfds", timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    print(f"quickstart: top1 {result['eval']['top1']:.4f} in {time.time() - started:.0f} s "
          f"(training {result['wall_time_s']:.0f} s)")
    assert result["eval"]["top1"] >= 0.90
