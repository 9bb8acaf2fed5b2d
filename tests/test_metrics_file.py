"""metrics.jsonl shared by two writers: whole lines under the lock, none lost to a trim."""

import json
import os
import subprocess
import sys

from expframe import metrics_file
from tests import main_runner as mr

_APPENDER = """
import sys
from expframe import metrics_file
path, split, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    metrics_file.append(path, [{"step": i, "split": split, "pad": "x" * 3000}])
"""


def test_two_processes_append_whole_lines_while_the_file_is_trimmed(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    metrics_file.append(path, [{"step": -1, "split": "train"}])
    n = 400
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, path, split, str(n)], cwd=mr.ROOT)
             for split in ("train", "eval")]
    trims = 0
    while any(p.poll() is None for p in procs):
        # A resuming trainer's trim: drops its own record at step -1 once, keeps the rest.
        metrics_file.rewrite(path, lambda text: "".join(
            line + "\n" for line in text.splitlines() if json.loads(line)["step"] != -1))
        trims += 1
    assert [p.wait() for p in procs] == [0, 0]
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]  # every line whole: each parses
    assert trims > 0
    for split in ("train", "eval"):
        assert [r["step"] for r in records if r["split"] == split] == list(range(n)), split
    assert len(records) == 2 * n


def test_records_skip_a_torn_last_line_and_sync_keeps_the_file(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    metrics_file.append(path, [{"step": 1, "split": "eval", "top1": 0.5}, {"step": 2, "split": "train"}])
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 3, "spl')  # a crash while a record was written
    metrics_file.sync(path)
    assert metrics_file.records(path) == [{"step": 1, "split": "eval", "top1": 0.5}, {"step": 2, "split": "train"}]
    assert os.path.getsize(path) > 0
    assert metrics_file.records(str(tmp_path / "missing.jsonl")) == []
