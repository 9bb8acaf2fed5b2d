"""benchmarks/profile_breakdown.py: exclusive times of nested events, and a real profile
of a matmul loop read back from the profiler's own files."""

import json
import os

import pytest
import tensorflow as tf

from tests import main_runner as mr


@pytest.fixture
def breakdown(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(mr.ROOT, "benchmarks"))
    import profile_breakdown as module  # pylint: disable=import-outside-toplevel
    return module


def test_an_event_owns_its_time_less_the_events_inside_it(breakdown):
    # outer [0, 100) holds a [10, 40) which holds b [20, 25); c [60, 70); then d [100, 130) after outer.
    events = [(0, 100, "Outer#id=1#"), (10, 30, "model/x:MatMul"), (20, 5, "Inner@7"), (60, 10, "y/z:MatMul"),
              (100, 30, "Outer#id=2#")]
    assert breakdown.exclusive(events) == {"Outer#id=#": 60 + 30, "MatMul": 25 + 10, "Inner": 5}
    assert breakdown.kind("resnet/conv1/Conv2D:Conv2D") == "Conv2D"
    assert breakdown.kind("MatMul_1:_MklMatMul") == "_MklMatMul"


def test_a_real_profile_is_read_back_by_kind(breakdown, tmp_path, capsys):
    x = tf.random.stateless_normal((256, 256), seed=(1, 2))

    @tf.function
    def chain(a):
        for _ in range(20):
            a = tf.matmul(a, x) / 16.0
        return a

    chain(x)
    folder = tmp_path / "224px_2rep_float32_expframe"
    tf.profiler.experimental.start(str(folder))
    try:
        chain(x).numpy()
    finally:
        tf.profiler.experimental.stop()
    (tmp_path / "not_a_profile").mkdir()
    found = breakdown.runners(str(tmp_path))
    assert list(found) == ["224px_2rep_float32_expframe"]
    run = found["224px_2rep_float32_expframe"]
    matmul = [k for k in run["by_kind_ms"] if k.endswith("MatMul")]   # _MklMatMul where oneDNN runs it
    assert matmul and run["by_kind_ms"][matmul[0]] > 0 and run["threads"] >= 1
    assert sum(run["by_kind_ms"].values()) == pytest.approx(run["busy_ms"])
    assert 0 < run["wall_ms"] and run["busy_ms"] <= run["threads"] * run["wall_ms"] + 1e-9
    assert breakdown.main([str(tmp_path), "--top", "5", "--calls", "2", "--out", str(tmp_path / "b.json")]) == 0
    assert f"| {matmul[0]} |" in capsys.readouterr().out
    halved = json.loads((tmp_path / "b.json").read_text())["224px_2rep_float32_expframe"]
    assert halved["by_kind_ms"][matmul[0]] == pytest.approx(run["by_kind_ms"][matmul[0]] / 2)
    assert breakdown.main([str(tmp_path / "not_a_profile")]) == 2
