"""Run names: readable, filesystem-safe and stable, made from a run's swept values.

    global_batch_size=128,learning_rate=0.002,train_steps=312,seed=1

Each swept binding is named by the shortest dotted suffix that no other swept binding
shares (`Trainer.global_batch_size` -> `global_batch_size`; `generator/Adam.learning_rate`
and `discriminator/Adam.learning_rate` -> `generator.Adam.learning_rate`, ...). A value
is its gin text with string quotes and the `@` of a reference dropped. Characters
outside `A-Z a-z 0-9 . _ + -` become `_`, and a value changed that way (or cut for
length) gets 8 hex digits of a hash of its exact gin text, so names stay unique.
Values of one binding that would read the same (the number `1` and the string `'1'`)
all get their hash, so none of them keeps the plain name that another one had. A
name depends only on the swept bindings and the values of that binding: adding a
value to a sweep never renames the runs already there, except a value that reads
the same as an existing one (then the existing one gets its hash too: its old
directory is left alone and never taken over by the new value).
"""

from __future__ import annotations

import collections
import hashlib
import re
from typing import Mapping, Sequence

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
MAX_VALUE_CHARS = 40
MAX_NAME_CHARS = 200
# Every character a run name can hold (for tests and for tools that check names).
NAME_CHARS = re.compile(r"^[A-Za-z0-9._+=,-]+$")


def digest(text: str) -> str:
    """8 hex digits of a SHA-1 of `text`: the same on every machine and Python."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]


def short_keys(bindings: Sequence[str]) -> dict[str, str]:
    """Each binding's shortest dotted suffix that no other binding in `bindings` shares.

    Args:
      bindings: swept bindings as typed, e.g. `Trainer.global_batch_size`,
        `generator/Adam.learning_rate`, `GLOBAL_BATCH` (a macro).

    Returns:
      binding -> key, e.g. `global_batch_size`, `generator.Adam.learning_rate`.
    """
    parts = {b: [p for p in re.split(r"[./]", b) if p] for b in bindings}
    keys = {}
    for b in bindings:
        for n in range(1, len(parts[b]) + 1):
            key = ".".join(parts[b][-n:])
            if all(".".join(parts[o][-n:]) != key for o in bindings if o != b):
                break
        keys[b] = key
    if len(set(keys.values())) < len(keys):  # one binding is a suffix of another
        keys = {b: ".".join(parts[b]) for b in bindings}
    return keys


def _readable(gin_text: str) -> str:
    text = gin_text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" and text[0] not in text[1:-1]:
        return text[1:-1]  # a plain string literal: its contents
    return text[1:] if text.startswith("@") else text


def value_names(gin_texts: Sequence[str]) -> dict[str, str]:
    """Filesystem-safe names of the values of one swept binding.

    Args:
      gin_texts: the values as gin text (`64`, `0.002`, `'cpu'`, `@SyncBatchNorm`).

    Returns:
      gin text -> name (`64`, `0.002`, `cpu`, `SyncBatchNorm`); distinct texts get
      distinct names.
    """
    names = {}
    for text in gin_texts:
        readable = _readable(text)
        safe = _UNSAFE.sub("_", readable)[:MAX_VALUE_CHARS]
        names[text] = safe if safe == readable and safe else f"{safe}_{digest(text)}".lstrip("_")
    # Texts that read the same (the string '1' and the number 1): hash every one of
    # them (counted before any is renamed), so none keeps the plain name.
    counts = collections.Counter(names.values())
    return {text: f"{name}_{digest(text)}" if counts[name] > 1 else name for text, name in names.items()}


def run_name(values: Mapping[str, str], keys: Mapping[str, str]) -> str:
    """The name of one run from its swept values.

    Args:
      values: binding -> value name (from `value_names`), in the study's order.
      keys: binding -> key (from `short_keys`).

    Returns:
      `key=value,key=value,...`, at most MAX_NAME_CHARS characters (a longer name is
      cut and ends with a hash of the whole).
    """
    name = ",".join(f"{keys[b]}={v}" for b, v in values.items())
    if len(name) > MAX_NAME_CHARS:
        name = f"{name[:MAX_NAME_CHARS - 10]}_h{digest(name)}"
    return name
