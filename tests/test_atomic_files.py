"""expframe.atomic_files: whole files or none, with the permissions of a plain write."""

import json
import os
import stat
import threading

import pytest

from expframe.atomic_files import write_json, write_text


def test_a_run_file_has_a_plain_writes_permissions_and_no_temporary_file_stays(tmp_path):
    """config.gin, result.json ... (`RunFiles`) are readable by the group where a plain
    write's would be (a temporary file from `tempfile.mkstemp` is 0600)."""
    from expframe.run_files import atomic_write  # pylint: disable=import-outside-toplevel
    old = os.umask(0o022)
    try:
        atomic_write(str(tmp_path / "config.gin"), "a = 1\n")
        with open(tmp_path / "plain.txt", "w", encoding="utf-8") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "config.gin").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "plain.txt").st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["config.gin", "plain.txt"]


def test_a_failed_write_leaves_the_old_file_whole_and_nothing_else(tmp_path):
    path = str(tmp_path / "result.json")
    write_json(path, {"step": 1})
    with pytest.raises(TypeError):
        write_json(path, {"step": object()})   # not JSON: fails before the file is touched
    with pytest.raises(TypeError):
        write_text(path, b"bytes, not text")    # fails inside the write of the temporary file
    assert json.loads(open(path, encoding="utf-8").read()) == {"step": 1}
    assert os.listdir(tmp_path) == ["result.json"]


def test_concurrent_writers_of_one_path_leave_one_whole_file(tmp_path):
    path = str(tmp_path / "deep" / "study.json")
    texts = {i: {"writer": i, "rows": list(range(2000))} for i in range(4)}

    def writer(i):
        for _ in range(25):
            write_json(path, texts[i], make_dirs=True)

    threads = [threading.Thread(target=writer, args=(i,)) for i in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(open(path, encoding="utf-8").read()) in texts.values()
    assert os.listdir(tmp_path / "deep") == ["study.json"]
