"""Every command and Python snippet in README.md and the guides runs, or says why not.

Sybil (https://sybil.readthedocs.io) finds the fenced blocks of each page. A block in
`sh` runs with bash in a scratch folder that holds links to the clone's `main.py`,
`experiments/`, `examples/` and `benchmarks/` (so what it writes stays there), and must
exit 0; a `python` block runs in the page's namespace, one block after the other. The
line right above a block may say how it runs instead:

    <!-- not run: REASON -->             not run here; REASON says why (a long run, a GPU...)
    <!-- run with: ARGS -->              each command of the block runs with ARGS appended
                                         (`--dry_run`, or bindings that shrink it)
    <!-- run by: tests/test_x.py -->     another default test runs this block as written

Blocks in other languages (`gin`, `text`) are read, not run; a block without a language
is an error, so nothing can hide from this test. The python snippets of the programming
model use `build_model`, `make_dataset`, `loss_fn` (and, on the architecture page,
`input_fn`, `step_fn`): the user's own functions, which `_namespace` stands in for with
a tiny model and random data.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from sybil import Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

from tests import main_runner as mr

# Written by other tools or owned elsewhere, not guides: results.md and conformance_matrix.md
# are generated (their commands are records of runs), planning.md is the planner's own page.
NOT_GUIDES = {"results.md", "conformance_matrix.md"}
PAGES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(mr.ROOT, "docs"))
    if f.endswith(".md") and f not in NOT_GUIDES)
LANGUAGES = {"sh", "python", "gin", "text"}
MARK = re.compile(r"<!-- (not run|run with|run by): (.*?) -->$")
LINKED = ("main.py", "experiments", "examples", "benchmarks")


class Block:
    """One fenced block: its language, source, and the mark on the line above it."""

    def __init__(self, page, line, language, source, mark):
        self.page, self.line, self.language, self.source = page, line, language, source
        self.kind, self.note = mark.groups() if mark else ("run", "")

    def __repr__(self):
        return f"{self.page}:{self.line} ({self.language})"


class BlockParser:
    """Sybil parser: a region per fenced block, evaluated by `_evaluate` below."""

    def __init__(self, page, blocks):
        self.lexer = FencedCodeBlockLexer(language=r"[\w-]*")
        self.page, self.blocks = page, blocks

    def __call__(self, document):
        for region in self.lexer(document):
            above = document.text[:region.start].rstrip(" \t").rsplit("\n", 2)
            mark = MARK.search(above[-2].strip()) if len(above) >= 2 else None
            line = document.text.count("\n", 0, region.start) + 1
            block = Block(self.page, line, region.lexemes["language"], str(region.lexemes["source"]), mark)
            self.blocks.append(block)
            region.parsed = region.lexemes["source"]
            region.evaluator = _evaluator(block)
            yield region


def _evaluator(block):
    python = PythonEvaluator()

    def evaluate(example):
        assert block.language in LANGUAGES, f"{block}: a fenced block needs one of the languages {sorted(LANGUAGES)}"
        if block.kind == "not run":
            assert block.note.strip(), f"{block}: 'not run' needs a reason"
            return None
        if block.kind == "run by":
            test = os.path.join(mr.ROOT, block.note.strip())
            with open(test, encoding="utf-8") as f:
                assert os.path.basename(block.page) in f.read(), f"{block}: {block.note} does not read this page"
            return None
        if block.language == "python":
            assert block.kind == "run", f"{block}: 'run with' is for sh blocks"
            return python(example)
        if block.language == "sh":
            return _run_sh(block, example.namespace["__workdir__"])
        return None
    return evaluate


def _commands(block):
    """The block's commands, continuation lines joined, each with the mark's ARGS appended."""
    joined = re.sub(r"\\\n\s*", "", block.source)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if block.kind == "run with":
            command, _, comment = line.partition("   #")  # a trailing comment stays after the args
            line = f"{command.rstrip()} {block.note}" + (f"   #{comment}" if comment else "")
        out.append(line)
    return out


def _run_sh(block, workdir):
    script = "\n".join(_commands(block))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir["cwd"], env=workdir["env"],
                          capture_output=True, text=True, timeout=600)
    workdir["outputs"][(block.page, block.line)] = done.stdout
    assert done.returncode == 0, (f"{block} exited {done.returncode}:\n{script}\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    assert "Traceback" not in done.stderr, f"{block}:\n{done.stderr[-3000:]}"
    return None


def _namespace(namespace):
    """The user's own functions that the programming-model snippets call: tiny stand-ins."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(512, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 512)

    def build_model():
        return keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(4)])

    def make_dataset():
        return tf.data.Dataset.from_tensor_slices({"image": images, "label": labels}).repeat()

    def loss_fn(logits, labels):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))

    def input_fn(ctx):
        return make_dataset().shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
            ctx.get_per_replica_batch_size(256))

    def step_fn(batch):  # reads the page's own model and optimizer
        model, opt = namespace["model"], namespace["opt"]
        with tf.GradientTape() as tape:
            loss = loss_fn(model(batch["image"], training=True), batch["label"])
        opt.minimize(loss, model.trainable_variables, tape)
        return {"loss": loss}

    namespace.update(keras=keras, tf=tf, build_model=build_model, make_dataset=make_dataset, loss_fn=loss_fn,
                     input_fn=input_fn, step_fn=step_fn)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch working folder with the clone's entry points linked in, and its environment."""
    cwd = tmp_path_factory.mktemp("docs_cwd")
    for name in LINKED:
        os.symlink(os.path.join(mr.ROOT, name), cwd / name)
    stubs = tmp_path_factory.mktemp("docs_bin")
    (stubs / "sbatch").write_text("#!/bin/sh\necho \"Submitted batch job 1 ($*)\"\n")  # no Slurm here
    (stubs / "sbatch").chmod(0o755)
    env = mr.env(tmp_path_factory.mktemp("docs_tfds"))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the quiet start is expframe's own
    env.update(HOME=str(tmp_path_factory.mktemp("docs_home")),
               PATH=os.pathsep.join([str(stubs), os.path.dirname(sys.executable), env["PATH"]]),
               PYTHONPATH=os.pathsep.join([mr.ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return {"cwd": str(cwd), "env": env, "outputs": {}}


def _parse(page, blocks):
    return Sybil(parsers=[BlockParser(page, blocks)]).parse(pathlib.Path(mr.ROOT, page))


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_says_why_not(page, workdir):
    blocks = []
    document = _parse(page, blocks)
    document.namespace["__workdir__"] = workdir
    if any(b.language == "python" and b.kind == "run" for b in blocks):
        _namespace(document.namespace)
    for example in document.examples():
        example.evaluate()
    if page == "README.md":  # the quickstart, shrunk, ends with its eval line as the README says
        quickstart = next(out for (p, _), out in workdir["outputs"].items() if p == page)  # its stdout
        last = quickstart.strip().splitlines()[-1]
        assert re.match(r"eval at step 4: loss \S+  top1 \S+  top5 \S+$", last), quickstart[-2000:]


def test_the_counts():
    """Every sh and python block is run here, run by another test, or says why not."""
    blocks = []
    for page in PAGES:
        list(_parse(page, blocks).examples())
    code = [b for b in blocks if b.language in ("sh", "python")]
    ran = [b for b in code if b.kind in ("run", "run with")]
    elsewhere = [b for b in code if b.kind == "run by"]
    skipped = [b for b in code if b.kind == "not run"]
    print(f"docs snippets: {len(ran)} run here, {len(elsewhere)} run by other tests, {len(skipped)} not run")
    assert len(ran) + len(elsewhere) + len(skipped) == len(code)
    assert all(b.note.strip() for b in skipped)
    assert all(b.language in LANGUAGES for b in blocks), [b for b in blocks if b.language not in LANGUAGES]
    assert len(ran) >= 8  # the front page's and the guides' cheap commands
    assert {b.page for b in ran} >= {"README.md", "docs/running.md", "docs/programming_model.md"}
