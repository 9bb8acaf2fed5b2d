"""Run names: stable, unique, filesystem-safe (expframe/sweep/naming.py)."""

import itertools
import os

from expframe.sweep import naming

BINDINGS = ["Trainer.global_batch_size", "keras.optimizers.Adam.learning_rate", "run_experiment.seed"]


def test_short_keys_are_the_shortest_unique_suffix():
    assert naming.short_keys(BINDINGS) == {
        "Trainer.global_batch_size": "global_batch_size",
        "keras.optimizers.Adam.learning_rate": "learning_rate", "run_experiment.seed": "seed"}
    assert naming.short_keys(["generator/Adam.learning_rate", "discriminator/Adam.learning_rate", "GLOBAL_BATCH"]) == {
        "generator/Adam.learning_rate": "generator.Adam.learning_rate",
        "discriminator/Adam.learning_rate": "discriminator.Adam.learning_rate", "GLOBAL_BATCH": "GLOBAL_BATCH"}
    # One binding is a suffix of another: both spelt out.
    keys = naming.short_keys(["Adam.learning_rate", "gen/Adam.learning_rate"])
    assert keys == {"Adam.learning_rate": "Adam.learning_rate", "gen/Adam.learning_rate": "gen.Adam.learning_rate"}


def test_value_names_are_readable_where_safe():
    texts = ["64", "0.002", "1e-05", "-3", "'cpu'", "@SyncBatchNorm", "@keras.optimizers.SGD", "True", "None"]
    assert list(naming.value_names(texts).values()) == [
        "64", "0.002", "1e-05", "-3", "cpu", "SyncBatchNorm", "keras.optimizers.SGD", "True", "None"]


def test_unsafe_values_get_a_hash_and_stay_distinct():
    texts = ["'a/b'", "'a b'", "'a_b'", "(64, 64, 3)", "[1, 2]", "@resnet()", "''", "'1'", "1", "'x' * 0 or 'y' * 99"]
    names = naming.value_names(texts)
    assert len(set(names.values())) == len(texts), names
    for text, name in names.items():
        assert naming.NAME_CHARS.match(name), (text, name)
        assert len(name) <= naming.MAX_VALUE_CHARS + 9
    assert names["'a_b'"] == "a_b"  # already safe: no hash
    assert names["'a/b'"].startswith("a_b_") and names["'a b'"].startswith("a_b_")
    assert names["'1'"] != names["1"]  # a string and a number that read the same


def test_run_names_are_stable_unique_and_filesystem_safe(tmp_path):
    axes = [["16", "64", "512"], ["1e-3", "'adam w'", "@SGD"], ["0", "1"]]
    keys = naming.short_keys(BINDINGS)
    value_names = [naming.value_names(a) for a in axes]

    def names(points):
        return [naming.run_name({b: vn[v] for b, vn, v in zip(BINDINGS, value_names, p, strict=True)}, keys)
                for p in points]

    points = list(itertools.product(*axes))
    first = names(points)
    assert first == names(points)  # stable: the same on every call
    assert len(set(first)) == len(points)  # unique
    assert first[0] == "global_batch_size=16,learning_rate=1e-3,seed=0"
    # A run's name depends only on its own values, not on the other points.
    value_names = [naming.value_names(a[:1]) for a in axes]
    assert names(points[:1]) == first[:1]
    for name in first:  # every name is a directory that can be created
        assert naming.NAME_CHARS.match(name) and not name.startswith((".", "-"))
        os.mkdir(tmp_path / name)
    assert len(os.listdir(tmp_path)) == len(points)


def test_long_names_are_cut_with_a_hash():
    keys = {f"b{i}": f"binding_number_{i}" for i in range(12)}
    values = {b: "1234567890" for b in keys}
    name = naming.run_name(values, keys)
    assert len(name) == naming.MAX_NAME_CHARS and naming.NAME_CHARS.match(name)
    assert name != naming.run_name(dict(values, b11="1234567891"), keys)



def test_values_that_read_the_same_all_get_a_hash():
    assert naming.value_names(["1"]) == {"1": "1"}
    for texts in (["1", "'1'"], ["'1'", "1", "2"], ["@cpu", "'cpu'"]):
        names = naming.value_names(texts)
        for text in texts[:2]:  # the two that read the same: each hashed, whatever the order
            assert names[text] == f"{naming.value_names([text])[text]}_{naming.digest(text)}", names
    assert naming.value_names(["'1'", "1", "2"])["2"] == "2"
    # A sweep of 1 ran in `1`; with the string '1' added, neither value takes that directory.
    assert "1" not in naming.value_names(["1", "'1'"]).values()
