"""How a run's process ends (`distrib_tf.run.ending`), the rows of docs/keras.md's table that
other tests do not play: a SIGTERM at the end of `fit` and in the script's code after it, on 2
workers, and what the lines after `fit` see (tests/workers/ending_cases.py)."""

import os
import re

import pytest

from cluster_runner import local_spec
from cluster_runner import run_cluster

ROOT = os.path.dirname(os.path.dirname(__file__))
SCRIPT = os.path.join(ROOT, "tests", "workers", "ending_cases.py")
STEPS = 8  # tests/workers/ending_cases.py: 2 epochs of 4 steps.

pytestmark = pytest.mark.multiworker


def _run(model_dir, case, *args):
    return run_cluster([SCRIPT, case, f"--model_dir={model_dir}", *args], spec=local_spec(2),
                       env={"PYTHONPATH": ROOT}, timeout=180)


def _preempted_at_once(results):
    """Every worker exits 75 with its line at the last step, before the script's next line."""
    for result in results:
        assert result.returncode == 75, (result.task, result.output[-3000:])
        assert f"{result.task} preempted: backed up step {STEPS} like every worker" in result.output, (
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


@pytest.mark.slow  # make soak: the same path as on_train_end's (a SIGTERM after the last agreed step).
def test_a_sigterm_at_the_last_step_exits_75_on_every_worker(tmp_path):
    _preempted_at_once(_run(tmp_path / "run", "last_step"))
