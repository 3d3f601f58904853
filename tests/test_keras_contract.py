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
