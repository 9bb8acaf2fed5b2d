"""Every collective a train step makes, per replica, does not grow with the replica count
(issue 59): each family's traced step at 2 and at 16 logical CPU replicas, the gradient
all-reduce included, and SyncBatchNorm on the issue's conv net against the design before
(which gathered an N-row table: its elements grow as N).

16 replicas need a process that splits its CPU into 16 (this one has 8): one subprocess
traces everything at 16 (~35 s); SN-GAN's step, the slowest to trace, is traced at 2 and 4
here and at 16 only under `-m slow`."""

import json
import os
import re
import sys

import pytest

from expframe import processes
from expframe.plan import collective_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHANNELS = (64, 128)  # the conv net
_AT_16 = """
import json, sys
sys.path.insert(0, "benchmarks")
import expframe
expframe.split_cpu(16)
from expframe.plan import collective_table as ct
import sync_batch_norm as before
for family in sys.argv[1].split(","):
    print(json.dumps(ct.audit(family, 16)), flush=True)
if sys.argv[2] == "net":
    gather = before.designs()["gather"]
    for group, norm, name in ((None, None, "shipped"), (2, None, "shipped_groups_of_2"), (None, gather, "gather")):
        print(json.dumps(dict(ct.sync_bn_net(16, group, norm), design=name)), flush=True)
"""


def _at_16(families, net=True):
    done = processes.run([sys.executable, "-c", _AT_16, ",".join(families), "net" if net else "-"],
                         "collectives at 16 replicas", cwd=ROOT, timeout=600,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stdout[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def at_16():
    out = _at_16(("classification", "d4pg"))
    return {"families": {r["family"]: r for r in out if "family" in r},
            "net": {r["design"]: r for r in out if "design" in r}}


@pytest.fixture(scope="module")
def at_2():
    return {f: collective_table.audit(f, 2) for f in ("classification", "d4pg")}


def _before():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import sync_batch_norm  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return sync_batch_norm.designs()["gather"]


def test_sync_batch_norm_elements_are_flat_in_the_replica_count(at_16):
    """Per layer of C channels, per replica: 2C + 1 forward, C in the far branch (first
    steps only), 2C backward, whatever N; with groups, 2C more: the moving mean's and
    variance's averages over all replicas (Replicator.scope()), whatever N."""
    per_layer = sum(5 * c + 1 for c in CHANNELS)                      # 962
    steady = sum(4 * c + 1 for c in CHANNELS)                         # 770
    grouped, grouped_steady = sum(7 * c + 1 for c in CHANNELS), sum(6 * c + 1 for c in CHANNELS)
    on_2, on_8 = collective_table.sync_bn_net(2), collective_table.sync_bn_net(8)
    groups_on_4 = collective_table.sync_bn_net(4, group_size=2)
    on_16, groups_on_16 = at_16["net"]["shipped"], at_16["net"]["shipped_groups_of_2"]
    for got in (on_2, on_8, on_16):
        assert (got["elements"], got["steady"]) == (per_layer, steady)
    for got in (groups_on_4, groups_on_16):
        assert (got["elements"], got["steady"]) == (grouped, grouped_steady)
    assert on_16["elements"] <= 1.25 * on_2["elements"]
    assert groups_on_16["elements"] <= 1.25 * groups_on_4["elements"]  # 4: the fewest replicas with 2 groups


def test_negative_control_the_gathered_table_grows_with_the_replica_count(at_16):
    """The design before issue 59: a padded N x 3C table forward and its gradient backward."""
    on_2 = collective_table.sync_bn_net(2, norm=_before())
    table = sum(2 * 3 * c for c in CHANNELS)  # per replica, per replica of the table
    assert on_2["elements"] == 2 * table == 2_304
    assert at_16["net"]["gather"]["elements"] == 16 * table == 18_432


@pytest.mark.parametrize("family", ["classification", "d4pg"])
def test_each_familys_step_sends_the_same_per_replica_on_2_and_16(family, at_2, at_16):
    on_2, on_16 = at_2[family], at_16["families"][family]
    assert on_16["per_replica"] == on_2["per_replica"]
    assert collective_table.summary(on_16) == collective_table.summary(on_2)
    # the gradient all-reduce is in it: one per update, of every trained parameter
    gradients = [r for r in on_2["collectives"] if r["kind"] == "gradients of one update (parameters)"]
    assert sorted(r["elements"] for r in gradients) == on_2["parameters"] and on_2["parameters"]
    assert not [r for r in on_2["collectives"] if r["kind"] == "other"]


def test_sngan_step_sends_the_same_per_replica_on_2_and_4():
    on_2, on_4 = collective_table.audit("sngan", 2), collective_table.audit("sngan", 4)
    assert on_4["per_replica"] == on_2["per_replica"]
    kinds = collective_table.summary(on_2)
    # disc_steps discriminator updates and one generator update, each all-reducing its gradients;
    # the generator's batch norms run in every update, differentiated in the generator's only.
    assert kinds["gradients of one update (parameters)"]["calls"] == 2
    forward = kinds["SyncBatchNorm forward: count, shifted sums (2C + 1)"]["calls"]
    assert forward == 2 * kinds["SyncBatchNorm backward: d mean, d var (2C)"]["calls"]


@pytest.mark.slow
def test_sngan_step_sends_the_same_per_replica_on_2_and_16():
    (on_16,) = _at_16(("sngan",), net=False)
    assert on_16["per_replica"] == collective_table.audit("sngan", 2)["per_replica"]


def test_docs_table_is_the_traced_one(at_2, at_16):
    """docs/planning.md's rows for the families traced here are what the tool prints."""
    with open(os.path.join(ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        doc = f.read()
    results = list(at_2.values()) + list(at_16["families"].values())
    rows = [line for line in collective_table.markdown(results).splitlines()
            if re.match(r"\| (classification|d4pg) \|", line)]
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc]
