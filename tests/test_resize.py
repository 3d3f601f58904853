"""The main job (CNN, float64) preempted on one number of workers and resumed on another
(issue 32), through the launcher: it ends where the uninterrupted 2-worker job ends, within
the layout test's float64 bound. `make soak` (4 jobs of 2 to 4 workers); `make test` has the
same cases for a user's script on the run API (`tests/test_run.py`)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cluster_runner import QUIET_TF
from cluster_runner import checkpoint_arrays
from cluster_runner import kill_left
from cluster_runner import weights_difference

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
FLAGS = ["--float64", "--global_batch_size=64", "--steps_per_epoch=8", "--epochs=2", "--backup_every_steps=2"]

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


def _job(workers, model_dir):
    return [sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}", "--grace_period=30", "--",
            sys.executable, "-m", "distrib_tf.train", *FLAGS, f"--model_dir={model_dir}"]


def _preempted(workers, model_dir, log):
    """Runs the job on `workers`, SIGTERMs it inside the second epoch; returns the agreed step."""
    with open(log, "w") as out:
        proc = subprocess.Popen(_job(workers, model_dir), env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "epoch 1/2" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, log.read_text()[-3000:]
    finally:
        kill_left([proc])
    return int(re.search(r"backed up step (\d+) like every worker", log.read_text()).group(1))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = subprocess.run(_job(2, model_dir), env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    return checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5")


@pytest.mark.parametrize("before, after", [(2, 1), (2, 4), (4, 2)])
def test_the_cnn_resumed_on_another_number_of_workers_ends_where_the_uninterrupted_job_ends(
        tmp_path, uninterrupted, before, after):
    model_dir = tmp_path / "run"
    step = _preempted(before, model_dir, tmp_path / "preempted.out")
    assert step < 16, step  # Inside the run, not at its end.
    done = subprocess.run(_job(after, model_dir), env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    resumed = re.findall(r"(chief|worker):\d resumes at step (\d+)", done.stdout)
    assert len(resumed) == after and {s for _, s in resumed} == {str(step)}, done.stdout[-3000:]
    difference = weights_difference(checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5"),
                                    uninterrupted)
    print(f"CNN float64: preempted at step {step} on {before} workers, resumed on {after}: weights {difference:.2g} "
          "(relative L2) from the uninterrupted 2-worker job")
    assert difference <= 1e-10  # tests/test_train.py, LAYOUT_CASES.
