"""How a run's process ends (`distrib_tf.run.ending`), the rows of docs/keras.md's table that
other tests do not play: a SIGTERM at the end of `fit` and in the script's code after it, on 2
workers, and what the lines after `fit` see (tests/workers/ending_cases.py); a SIGTERM in an
epoch's end (tests/workers/epoch_end.py)."""

import json
import os
import pathlib
import re

import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_single

ROOT = os.path.dirname(os.path.dirname(__file__))
SCRIPT = os.path.join(ROOT, "tests", "workers", "ending_cases.py")
EPOCH_END = os.path.join(ROOT, "tests", "workers", "epoch_end.py")
STEPS = 8  # tests/workers/ending_cases.py: 2 epochs of 4 steps.

pytestmark = pytest.mark.multiworker


def _run(model_dir, case, *args):
    return run_cluster([SCRIPT, case, f"--model_dir={model_dir}", *args], spec=local_spec(2),
                       env={"PYTHONPATH": ROOT}, timeout=180)


def _preempted_at_once(results, step=STEPS):
    """Every worker exits 75 with its line (having backed up `step`), before the script's next line."""
    for result in results:
        assert result.returncode == 75, (result.task, result.output[-3000:])
        assert f"{result.task} preempted: backed up step {step} like every worker" in result.output, (
            result.output[-3000:])
        assert "Traceback" not in result.output and "Exception ignored" not in result.output, result.output[-3000:]


@pytest.mark.parametrize("block", ["with", "without_with"])
def test_a_sigterm_in_on_train_end_exits_75_on_every_worker_at_once(tmp_path, block):
    """Issue 53 item 1: the chief's SIGTERM in its own `on_train_end` (its last checkpoint
    being written): the script went on past `fit`, then a traceback and exit 1 in `with`, and
    "Exception ignored in atexit callback" and exit 0 without; worker:1, already past `fit`,
    died of the default SIGTERM (143). Now both leave `fit` together and exit 75 there."""
    results = _run(tmp_path / "run", "on_train_end", *(["--no_with"] if block == "without_with" else []))
    _preempted_at_once(results)
    for result in results:
        assert f"{result.task} after fit" not in result.output, result.output[-3000:]


def test_the_lines_after_fit_read_the_chiefs_files_and_a_sigterm_there_exits_75(tmp_path):
    """Issue 51 item 4: worker:1 loading the file the chief's callback wrote in `on_train_end`
    found none (the chief was still writing it); a SIGTERM in a final `evaluate` after `fit`
    gave 130 ("not every task saved its state"). Now every worker loads it, the SIGTERM
    exits 75 on every worker, and a restart returns `fit` at once and runs the rest again."""
    results = _run(tmp_path / "run", "after_fit")
    for result in results:
        assert f"{result.task} loaded " in result.output, result.output[-3000:]
        assert result.returncode == 75, (result.task, result.output[-3000:])
        assert f"{result.task} preempted: backed up step {STEPS} like every worker" in result.output
        assert f"{result.task} evaluated" not in result.output
    again = _run(tmp_path / "run", "none")
    for result in again:
        assert result.returncode == 0, (result.task, result.output[-3000:])
        assert re.search(rf"{result.task} resumes at step {STEPS} \(epoch 3, step 0", result.output), (
            result.output[-3000:])  # Its end, with nothing left to train.
        assert f"{result.task} evaluated" in result.output and f"{result.task} after the run" in result.output


@pytest.mark.slow  # make soak: the same path as test_a_sigterm_in_an_epochs_end...[last_step]'s.
def test_a_sigterm_at_the_last_step_exits_75_on_every_worker(tmp_path):
    """The last step is its epoch's: every worker backs up the step before it (the restart runs
    the last step and the epoch's end again) and exits 75 at once."""
    _preempted_at_once(_run(tmp_path / "run", "last_step"), step=STEPS - 1)


EPOCH_END_STEPS = 4  # tests/workers/epoch_end.py: 3 epochs of 4 steps, the SIGTERM in the second's end.
EPOCH_END_FILES = [f"shared/save_at_{e}.weights.h5" for e in (1, 2, 3)] + [
    f"checkpoints/epoch00{e}.{kind}" for e in (1, 2, 3) for kind in ("weights.h5", "json")]


def _epoch_end_run(model_dir, case):
    results = run_cluster([EPOCH_END, case, f"--model_dir={model_dir}"], spec=local_spec(2),
                          env={"PYTHONPATH": ROOT}, timeout=180)
    return results, {r.task: _result(r) for r in results}


def _result(result):
    found = re.search(r"^RESULT (\{.*\})$", result.output, re.M)
    return json.loads(found.group(1)) if found else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run's RESULT lines and files (one for every case: `--dist loadfile`)."""
    model_dir = tmp_path_factory.mktemp("uninterrupted")
    results, found = _epoch_end_run(model_dir, "none")
    check_ok(results)
    return model_dir, found


@pytest.mark.parametrize("case", [
    "validation", "last_step", "on_epoch_end",
    # make soak: worker:1 leaves after validation's last collective while the chief is in its
    # on_epoch_end callbacks, whose collective then fails (about 10 s; before, the chief exited 1).
    pytest.param("validation_end", marks=pytest.mark.slow)])
def test_a_sigterm_in_an_epochs_end_makes_that_end_once_on_restart(tmp_path, uninterrupted, case):
    """Issue 51 item 3: a SIGTERM in validation or at an epoch's last step backed up that step
    without its end, and the restart began the next epoch: no History row, no `val_*`, no
    `ModelCheckpoint` file and no chief's checkpoint for that epoch. Now every worker backs up
    the step before the epoch's last (whichever worker got the SIGTERM) and the restart makes
    that end once; in an `on_epoch_end` every worker finishes the end and backs it up. History,
    callbacks' states, weights and every file equal the uninterrupted run's, bit for bit."""
    reference_dir, reference = uninterrupted
    model_dir = tmp_path / "run"
    results, _ = _epoch_end_run(model_dir, case)
    sender = "worker:1" if case.startswith("validation") else "worker:0"
    assert f"{sender} SIGTERM in {case}" in next(r.output for r in results if r.task == sender), (
        [r.output[-3000:] for r in results])  # It landed where meant.
    # In validation or at the last step: the step before the epoch's last, whose end the restart
    # makes. In an on_epoch_end: every worker finishes that end and backs it up.
    step = 2 * EPOCH_END_STEPS - (case != "on_epoch_end")
    _preempted_at_once(results, step=step)
    results, restarted = _epoch_end_run(model_dir, "none")
    check_ok(results)
    resumed = "epoch 3, step 0" if case == "on_epoch_end" else "epoch 2, step 3"
    for result in results:
        assert f"{result.task} resumes at step {step} ({resumed} of it)" in result.output, result.output[-3000:]
    assert restarted == reference
    for name in EPOCH_END_FILES:
        assert (model_dir / name).read_bytes() == pathlib.Path(reference_dir, name).read_bytes(), name


@pytest.mark.slow  # make soak: the one-process path of the test above (no barrier; `Preempted` raised).
def test_a_sigterm_in_an_epochs_end_in_one_process_makes_that_end_once(tmp_path):
    """The three cases above in one process: the same History, states, weights and files as
    the uninterrupted one-process run."""
    def run(model_dir, case):
        result = run_single([EPOCH_END, case, f"--model_dir={model_dir}", "--sigterm_task=chief:0"],
                            env={"PYTHONPATH": ROOT}, timeout=180)
        return result, _result(result)

    reference, expected = run(tmp_path / "uninterrupted", "none")
    assert reference.returncode == 0, reference.output[-3000:]
    for case in ("validation", "last_step", "on_epoch_end"):
        model_dir = tmp_path / case
        preempted, _ = run(model_dir, case)
        step = 2 * EPOCH_END_STEPS - (case != "on_epoch_end")
        assert preempted.returncode == 75 and f"chief:0 SIGTERM in {case}" in preempted.output, preempted.output[-3000:]
        assert f"chief:0 preempted: backed up step {step}" in preempted.output, preempted.output[-3000:]
        restarted, found = run(model_dir, "none")
        assert restarted.returncode == 0 and f"chief:0 resumes at step {step} " in restarted.output, (
            restarted.output[-3000:])
        assert found == expected, case
        for name in EPOCH_END_FILES:
            assert (model_dir / name).read_bytes() == (tmp_path / "uninterrupted" / name).read_bytes(), (case, name)
