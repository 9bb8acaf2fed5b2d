"""The README and docs/ stand alone: every file they point to is in the repository."""

import glob
import os
import re

from tests import main_runner as mr

DOCS = [os.path.join(mr.ROOT, "README.md")] + sorted(glob.glob(os.path.join(mr.ROOT, "docs", "*.md")))
# Markdown links [text](target) and paths in backticks that look like repository files.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"`((?:\.\./|\./)?(?:[\w.-]+/)+[\w.-]+\.(?:md|py|gin))`")


def _references(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [m for m in LINK.findall(text) if "://" not in m] + PATH.findall(text)


def test_docs_exist_and_readme_links_the_architecture():
    assert os.path.join(mr.ROOT, "docs", "architecture.md") in DOCS
    assert "docs/architecture.md" in _references(DOCS[0])


def test_every_referenced_file_is_in_the_repository():
    for doc in DOCS:
        for ref in _references(doc):
            if "<" in ref or "*" in ref:
                continue  # a pattern such as experiments/<name>.gin
            here = os.path.normpath(os.path.join(os.path.dirname(doc), ref))
            from_root = os.path.normpath(os.path.join(mr.ROOT, ref))
            inside = [p for p in (here, from_root) if p.startswith(mr.ROOT + os.sep)]
            assert inside, f"{os.path.relpath(doc, mr.ROOT)} points outside the repository: {ref}"
            assert any(os.path.exists(p) for p in inside), f"{os.path.relpath(doc, mr.ROOT)}: no such file {ref}"
