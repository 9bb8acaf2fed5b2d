"""The README and docs/ stand alone: every file and anchor they point to is in the repository."""

import glob
import os
import re

from tests import main_runner as mr

DOCS = [os.path.join(mr.ROOT, "README.md")] + sorted(glob.glob(os.path.join(mr.ROOT, "docs", "*.md")))
# Written by tools, not by hand (expframe.reproduce, tests.conformance.matrix): their own
# tests check them; their links into README and the guides are checked for files only.
GENERATED = {"results.md", "conformance_matrix.md"}
# Markdown links [text](target) and paths in backticks that look like repository files.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ANCHORED = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
PATH = re.compile(r"`((?:\.\./|\./)?(?:[\w.-]+/)+[\w.-]+\.(?:md|py|gin))`")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def _text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _references(path):
    text = _text(path)
    return [m for m in LINK.findall(text) if "://" not in m] + PATH.findall(text)


def anchors(path):
    """The anchors GitHub makes for a Markdown file: its headings' slugs and <a id>s."""
    text = FENCE.sub("", _text(path))
    out, seen = set(re.findall(r'<a id="([^"]+)">', text)), {}
    for heading in re.findall(r"^#+ +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_docs_exist_and_readme_links_the_architecture():
    assert os.path.join(mr.ROOT, "docs", "architecture.md") in DOCS
    assert "docs/architecture.md" in _references(DOCS[0])


def test_slugs_follow_github():
    assert {"the-command-line-and-exit-codes-contract", "the-task-interface"} <= anchors(
        os.path.join(mr.ROOT, "docs", "architecture.md"))
    assert "precision-and-xla-measured-where-they-run" in anchors(os.path.join(mr.ROOT, "docs", "hardware.md"))


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


def test_every_link_to_a_section_finds_it():
    """README and the guides link to sections that exist (GitHub's heading anchors)."""
    for doc in DOCS:
        if os.path.basename(doc) in GENERATED:
            continue
        for target, anchor in ANCHORED.findall(FENCE.sub("", _text(doc))):
            path = os.path.normpath(os.path.join(os.path.dirname(doc), target)) if target else doc
            if not path.endswith(".md"):
                continue
            where = os.path.relpath(doc, mr.ROOT)
            assert anchor in anchors(path), f"{where}: no section #{anchor} in {target or 'itself'}"


def test_readme_is_a_front_page():
    """At most 150 lines; the install-and-quickstart and test commands come first, in that
    order (the test command is the one .ci/run runs); every guide is linked."""
    text = _text(DOCS[0])
    assert len(text.splitlines()) <= 150
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
    assert "pip install -e \".[test]\"" in blocks[0] and "experiments/quickstart.gin" in blocks[0]
    assert blocks[1].strip() == "python -m pytest -q"
    assert "python -m pytest -q" in _text(os.path.join(mr.ROOT, ".ci", "run"))
    guides = {os.path.basename(d) for d in DOCS[1:]} - {"sngan_standing_statistics.md", "conformance_matrix.md"}
    assert {f"docs/{g}" for g in guides} <= set(_references(DOCS[0])), guides
