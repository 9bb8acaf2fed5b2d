"""Writing a file whole or not at all: a temporary file in the same folder, then a rename.

A reader (or a crash, or a second process writing the same path) never sees half a file:
`os.replace` swaps the name in one step on POSIX and Windows. The temporary file is
created with the permissions an ordinary `open(path, "w")` would give (0666 less the
umask), so results stay readable by the group where a plain write's would; and under a
unique hidden name, so concurrent writers never share one. No TensorFlow here: the
benchmarks' parent processes and `python -m expframe.launch` import this before choosing
TensorFlow's settings.

Example:
    from expframe.atomic_files import write_json, write_text
    write_text("runs/x/config.gin", text)
    write_json("runs/x/result.json", {"step": 100}, make_dirs=True)
"""

import json
import os
import secrets


def write_text(path: str, text: str, make_dirs: bool = False) -> None:
    """Writes `text` (UTF-8) to `path` atomically; `make_dirs` creates its folder first."""
    folder = os.path.dirname(os.path.abspath(path))
    if make_dirs:
        os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp_{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, data, indent: int = 2, make_dirs: bool = False, **dumps_kwargs) -> None:
    """Writes `data` as JSON (one trailing newline) to `path` atomically; `dumps_kwargs` go
    to `json.dumps` (e.g. `sort_keys=True`, `default=str`)."""
    write_text(path, json.dumps(data, indent=indent, **dumps_kwargs) + "\n", make_dirs=make_dirs)
