"""The main job preempted on one number of workers and resumed on another (issue 32), through
the launcher: it ends where the uninterrupted 2-worker job ends, within the layout test's
bound (the CNN in float64, the transformer in float32: `tests/test_train.py`, LAYOUT_CASES).
`make soak` (8 jobs of 2 to 4 workers); `make test` has the same cases for a user's script on
the run API (`tests/test_run.py`)."""

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
FLAGS = ["--global_batch_size=64", "--steps_per_epoch=8", "--epochs=2", "--backup_every_steps=2"]
MODELS = {  # model: (its flags, the layout test's bound on the final weights)
    "cnn": (["--model=cnn", "--float64"], 1e-10),
    "transformer": (["--model=transformer"], 1e-5),
}

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


def _job(model, workers, model_dir):
    return [sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}", "--grace_period=30", "--",
            sys.executable, "-m", "distrib_tf.train", *MODELS[model][0], *FLAGS, f"--model_dir={model_dir}"]


def _preempted(model, workers, model_dir, log):
    """Runs the job on `workers`, SIGTERMs it inside the second epoch; returns the agreed step."""
    with open(log, "w") as out:
        proc = subprocess.Popen(_job(model, workers, model_dir), env=ENV, stdout=out, stderr=subprocess.STDOUT)
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
    """The final weights of the uninterrupted 2-worker job, by model (run once each)."""
    cache = {}

    def of(model):
        if model not in cache:
            model_dir = tmp_path_factory.mktemp(f"uninterrupted_{model}") / "run"
            done = subprocess.run(_job(model, 2, model_dir), env=ENV, capture_output=True, text=True, timeout=400)
            assert done.returncode == 0, done.stdout[-3000:]
            cache[model] = checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5")
        return cache[model]
    return of


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("before, after", [(2, 1), (2, 4), (4, 2)])
def test_resumed_on_another_number_of_workers_the_job_ends_where_the_uninterrupted_job_ends(
        tmp_path, uninterrupted, model, before, after):
    model_dir = tmp_path / "run"
    step = _preempted(model, before, model_dir, tmp_path / "preempted.out")
    assert step < 16, step  # Inside the run, not at its end.
    done = subprocess.run(_job(model, after, model_dir), env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    resumed = re.findall(r"(chief|worker):\d resumes at step (\d+)", done.stdout)
    assert len(resumed) == after and {s for _, s in resumed} == {str(step)}, done.stdout[-3000:]
    difference = weights_difference(checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5"),
                                    uninterrupted(model))
    print(f"{model} {'float64' if '--float64' in MODELS[model][0] else 'float32'}: preempted at step {step} on "
          f"{before} workers, resumed on {after}: weights {difference:.2g} (relative L2) from the uninterrupted "
          "2-worker job")
    assert difference <= MODELS[model][1]  # tests/test_train.py, LAYOUT_CASES.
