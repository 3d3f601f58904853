"""The harness of `make test-keras` (tests/keras_contract/): its comparison and refusal list, without TensorFlow."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "keras_contract", "contract.py")
_spec = importlib.util.spec_from_file_location("keras_contract_contract", _PATH)
contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contract)


def test_the_gap_is_what_passes_plainly_and_fails_with_the_run():
    plain = {"a": {"outcome": "passed"}, "b": {"outcome": "failed"}, "c": {"outcome": "passed"},
             "d": {"outcome": "skipped"}}
    run = {"a": {"outcome": "failed", "error": "E: a"}, "b": {"outcome": "failed", "error": "E: b"},
           "c": {"outcome": "passed", "error": ""}, "d": {"outcome": "failed", "error": "E: d"}}
    assert contract.gap_of(plain, run) == {"a": "E: a"}


def test_plain_runs_what_fails_with_the_run_and_finds_the_same_gap_and_stale_refusals():
    # Every pair of outcomes (plain, run) of a test, and a refusal of each: the plain
    # outcomes of `plain_needed`'s tests alone give the gap and the stale refusals of all.
    outcomes = ("passed", "failed", "skipped")
    pairs = {f"k/a_test.py::T::test_{p}_{r}": (p, r) for p in outcomes for r in outcomes}
    plain = {test: {"outcome": p} for test, (p, _) in pairs.items()}
    run = {test: {"outcome": r, "error": f"E: {test}"} for test, (_, r) in pairs.items()}
    refusals = {("one", test): "why" for test in pairs} | {("two", "k/a_test.py::T::test_passed_failed"): "why"}
    needed = contract.plain_needed(run)
    assert needed == sorted(test for test, (_, r) in pairs.items() if r == "failed")
    subset = {test: plain[test] for test in needed}
    assert contract.gap_of(subset, run) == contract.gap_of(plain, run) == {
        "k/a_test.py::T::test_passed_failed": "E: k/a_test.py::T::test_passed_failed"}
    stale = contract.stale_of(refusals, "one", run, contract.gap_of(subset, run))
    assert stale == contract.stale_of(refusals, "one", run, contract.gap_of(plain, run))
    assert sorted(test for _, test in stale) == sorted(set(pairs) - {"k/a_test.py::T::test_passed_failed"})


def test_the_plain_run_collects_the_files_of_its_tests_once():
    tests = ["k/b_test.py::T::test_x[1]", "k/a_test.py", "k/b_test.py::T::test_y", "k/a_test.py::U::test_z"]
    assert contract.files_of(tests) == ["k/b_test.py", "k/a_test.py"]


def test_refusals_read_per_layout(tmp_path):
    path = tmp_path / "refusals.txt"
    path.write_text("# A group\nboth k/a_test.py::T::test_a -- a reason\n\ntwo k/b_test.py::T::test_b -- another\n")
    assert contract.load_refusals(str(path)) == {
        ("one", "k/a_test.py::T::test_a"): "a reason", ("two", "k/a_test.py::T::test_a"): "a reason",
        ("two", "k/b_test.py::T::test_b"): "another"}


@pytest.mark.parametrize("line", ["one k/a_test.py::T::test_a", "three k/a_test.py::T::test_a -- why",
                                  "one k/a_test.py::T::test_a --  "])
def test_a_refusal_needs_a_layout_and_a_reason(tmp_path, line):
    path = tmp_path / "refusals.txt"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="Invalid line 1 in .*Expected `one/two/both TEST_ID -- one-line reason`"
                       .replace("/", "\\|")):
        contract.load_refusals(str(path))


def test_the_committed_refusal_list_reads():
    contract.load_refusals()
