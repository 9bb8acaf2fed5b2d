"""The conformance matrix in the default tests (issue 18, items 1 and 3): every shipped
task family x precision x CPU target either takes the float32 1-replica run's first
updates or is refused before tracing with one line naming the binding to change, and
docs/conformance_matrix.md shows what this run found (see tests/conformance/matrix.py).

The default tests run the matrix once (two processes of single-process combinations
side by side with the cluster launches) and each reads its results; a few costly cells
run only with `-m slow` (`matrix.combinations`: mixed precision on the cluster targets),
which runs the whole matrix. Every family at every precision on 1 and 2 CPU replicas is
in the default tests."""

import os

import pytest

from tests.conformance import matrix

# About 4 minutes on 2 idle cores (README, Tests); far longer on a loaded machine.
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def results(data_dir, tmp_path_factory):
    return matrix.run_matrix(str(data_dir), str(tmp_path_factory.mktemp("conformance")))


def _failures(results, combos):
    return [f"{c.key}: {why}" for c in combos for ok, why in [matrix.passes(c, results[c.key])] if not ok]


def test_every_combination_matches_float32_or_is_refused(results):
    failures = _failures(results, matrix.combinations(slow=False))
    assert not failures, "\n".join(failures)
    # Every shipped family is covered, with a cluster target and both 1 and 2 replicas.
    ran = {(c.family, c.target) for c in matrix.combinations(slow=False) if results[c.key]["result"] == "ran"}
    assert {f for f, _ in ran} == set(matrix.FAMILIES)
    for family in ("classification", "sngan", "d4pg", "d4pg_pixels"):
        for target in ("cpu x1", "cpu x2"):
            for precision in matrix.PRECISIONS:
                assert results[f"{family} | {target} | {precision}"]["result"] == "ran"
    for precision in matrix.PRECISIONS:
        assert results[f"keras | cpu x1 | {precision}"]["result"] == "ran"
    assert {("classification", "multi_worker x2"), ("classification", "parameter_server x1"),
            ("d4pg", "cpu x2"), ("d4pg_pixels", "cpu x2"), ("sngan", "cpu x2"), ("vit_mesh", "mesh 2x2"),
            ("keras", "cpu x2"), ("keras", "multi_worker x2"), ("keras", "parameter_server x1")} <= ran


def test_runs_start_from_the_same_initialisation_and_train(results):
    """The update is measured from the reference's initial parameters: every run in this
    process group starts from them, and the reference moves (the comparison is not empty)."""
    for combo in matrix.combinations(slow=False):
        result = results[combo.key]
        if result["result"] == "ran" and "initial_max_abs_diff" in result:
            assert result["initial_max_abs_diff"] == 0.0, combo.key
    for family in matrix.FAMILIES:
        assert results[matrix.reference(family).key]["agreement"]["update_norm"] > 1e-5, family


def test_d4pg_under_mixed_float16_takes_the_float32_update(results):
    """Item 3: D4PG never scaled its losses, so under mixed_float16 every gradient was
    divided by the loss scale (2^15) and the update shrank; it now matches."""
    for target in ("cpu x1", "cpu x2"):
        agreement = results[f"d4pg | {target} | mixed_float16"]["agreement"]
        assert abs(agreement["norm_ratio"] - 1) <= matrix.MIXED_NORM_TOLERANCE, (target, agreement)
        assert agreement["cosine"] > matrix.MIXED_MIN_COSINE["mixed_float16"], (target, agreement)


def test_the_compiled_keras_model_takes_the_classification_tasks_updates(results):
    """Issue 51: KerasModelTask, given the classification family's ResNet compiled with the
    same optimizer and loss, takes ClassificationTask's first updates: the same parameter
    names, equal to float32 tolerance (measured: equal)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    ends = [dict(np.load(os.path.join(results[matrix.reference(f).key]["model_dir"], "end.npz")))
            for f in ("classification", "keras")]
    assert sorted(ends[0]) == sorted(ends[1]) and len(ends[0]) > 10
    assert max(float(np.abs(ends[0][k] - ends[1][k]).max()) for k in ends[0]) <= matrix.FLOAT32_ATOL


def test_a_refusal_runs_through_main_py_and_its_process_is_checked(results):
    """Issue 30: every refusal ran in a group's process, where "exit 2" was the error class's
    constant and could not fail; one goes through `python main.py` as a user's command does."""
    via = [c for c in matrix.combinations(slow=False) if c.via_main]
    assert [c.key for c in via] == ["vit_mesh | cpu x1 | float32"]
    result = results[via[0].key]
    assert (result["via"], result["exit_code"], result["output_lines"], result["wrote"]) == ("main.py", 2, 1, False)
    assert result["error"].startswith("MeshClassificationTask needs Replicator.target='mesh'"), result
    assert matrix.result_text(via[0], result) == "refused: `Replicator.target`"


def _fake_results():
    out = {}
    for combo in matrix.combinations():
        if combo.refusal:
            out[combo.key] = {"result": "refused", "exit_code": 2, "wrote": False, "via": "main.py", "output_lines": 1,
                              "error": "Replicator.target='x' cannot; set Replicator.target"}
        else:
            out[combo.key] = {"result": "ran", "agreement": {"max_abs_diff": 0.0, "cosine": 1.0, "norm_ratio": 1.0,
                                                             "update_norm": 0.5}}
    return out


def test_reference_rows_read_reference_not_matches_against_themselves():
    rows = {key: (result, line) for line in matrix.render(_fake_results(), "here").splitlines()
            for key, _, result in matrix.table_rows(line)}
    references = {matrix.reference(f).key for f in matrix.FAMILIES}
    assert references == {"classification | cpu x1 | float32", "sngan | cpu x1 | float32",
                          "d4pg | cpu x1 | float32", "d4pg_pixels | cpu x1 | float32",
                          "vit_mesh | mesh 1x1 | float32", "keras | cpu x1 | float32"}
    for key in references:
        assert rows[key][0] == "reference" and rows[key][1].endswith("| reference | | | |"), rows[key]
    assert rows["classification | cpu x2 | float32"] == (
        "matches", "| classification | cpu x2 | float32 | default | matches | 0.00e+00 | 1.000000 | 1.0000 |")
    assert sum(result == "reference" for result, _ in rows.values()) == 6


def test_a_refusal_through_main_py_must_be_its_only_line_from_main_py():
    combo = next(c for c in matrix.combinations() if c.via_main)
    refused = {"result": "refused", "exit_code": 2, "wrote": False, "via": "main.py", "output_lines": 1,
               "error": "MeshClassificationTask needs Replicator.target='mesh' (the target is 'cpu'); set "
                        "Replicator.target and Replicator.mesh_shape."}
    assert matrix.passes(combo, refused)[0]
    assert not matrix.passes(combo, dict(refused, output_lines=3))[0]  # a traceback or noise besides the line
    assert not matrix.passes(combo, dict(refused, via="launch"))[0]
    assert not matrix.passes(combo, dict(refused, exit_code=1))[0]
    assert not matrix.passes(combo, dict(refused, wrote=True))[0]


def _check_table(results, slow):
    with open(matrix.DOC, encoding="utf-8") as f:
        committed = f.read()
    stale = f"{os.path.relpath(matrix.DOC)} is out of date; regenerate it: {matrix.REGENERATE}"
    assert committed.startswith(matrix.header()), stale
    rows = matrix.table_rows(committed)
    assert [(key, suite) for key, suite, _ in rows] == [(c.key, c.suite) for c in matrix.combinations()], stale
    fresh = [(c.key, c.suite, matrix.result_text(c, results[c.key])) for c in matrix.combinations(slow)]
    assert [row for row in rows if slow or row[1] == "default"] == fresh, stale


def test_committed_table_has_these_combinations_results_and_thresholds(results):
    _check_table(results, slow=False)


@pytest.mark.slow
def test_whole_matrix(data_dir, tmp_path):
    """Every combination, the slow ones too (as the table is generated)."""
    everything = matrix.run_matrix(str(data_dir), str(tmp_path), slow=True)
    failures = _failures(everything, matrix.combinations())
    assert not failures, "\n".join(failures)
    _check_table(everything, slow=True)
