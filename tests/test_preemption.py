"""Preemption through the launcher: SIGTERM mid-epoch, every worker saves one step, no step lost."""

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

pytestmark = pytest.mark.multiworker


# Steps an epoch: the second epoch must outlast the SIGTERM's 1 s wait and the agreement on a
# step, also on a loaded machine (the transformer's steps take a few ms: 30 were done before it).
STEPS = {"cnn": 90, "transformer": 120}


def _job(model_dir, model, dataset):
    return [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
            "--grace_period=30", "--", sys.executable, "-m", "distrib_tf.train", f"--model={model}",
            f"--dataset={dataset}", "--epochs=2", f"--steps_per_epoch={STEPS[model]}", f"--model_dir={model_dir}"]


def _run(model_dir, model, dataset):
    result = subprocess.run(_job(model_dir, model, dataset), env=ENV, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


# make soak: tests/test_run.py's own-disk preemption (a user's script, a random step, bit-identical)
# and tests/test_preemption_soak.py cover this path in make test.
@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_sigterm_mid_epoch_loses_no_step(tmp_path, model, shapes_on_disk):
    """The CNN streams `shapes` from disk (each worker reads its own examples); the transformer
    reads `tokens` from memory: both resume at the agreed step, bit-identical."""
    dataset = shapes_on_disk if model == "cnn" else "tokens"
    reference = _run(tmp_path / "uninterrupted", model, dataset)
    model_dir = tmp_path / "preempted"
    log = tmp_path / "launcher.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(_job(model_dir, model, dataset), env=ENV, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "worker:1 epoch 1/2" not in log.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # Into the second epoch.
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    text = log.read_text()
    assert code == 75, text[-3000:]
    saved = re.findall(r"(worker:\d) preempted: backed up step (\d+)", text)
    assert sorted(task for task, _ in saved) == ["worker:0", "worker:1"], text[-3000:]
    steps = {int(step) for _, step in saved}
    assert len(steps) == 1, saved  # One step, agreed by both.
    step = steps.pop()
    assert STEPS[model] < step < 2 * STEPS[model], step  # Mid-epoch 2, not at an epoch's end.
    resumed = _run(model_dir, model, dataset)
    assert sorted(re.findall(r"(worker:\d) resumes at step (\d+)", resumed)) == [
        ("worker:0", str(step)), ("worker:1", str(step))], resumed[-3000:]  # 0 steps lost.
    difference = weights_difference(
        checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5"),
        checkpoint_arrays(tmp_path / "uninterrupted" / "checkpoints" / "epoch002.weights.h5"))
    fingerprints = [set(re.findall(r"final weights sha256 (\w+)", t)) for t in (resumed, reference)]
    print(f"{model}: preempted at step {step} of {2 * STEPS[model]}: 0 steps lost; weights differ from an "
          f"uninterrupted "
          f"run by {difference:.2g} (relative L2), bit-identical: {fingerprints[0] == fingerprints[1]}")
    assert fingerprints[0] == fingerprints[1] and len(fingerprints[0]) == 1, fingerprints  # Bit-identical.
    assert difference == 0


PHASE_STEPS = 4  # Steps an epoch; 2 epochs.


@pytest.mark.parametrize("phase", [  # make soak runs the three the others cover in part (validation:
    pytest.param("start-up", marks=pytest.mark.slow),  # one worker's SIGTERM there, below).
    pytest.param("validation", marks=pytest.mark.slow),
    pytest.param("final-evaluate", marks=pytest.mark.slow), "export"])
def test_sigterm_outside_training_batches_exits_75_and_the_job_resumes(tmp_path, phase):
    """A SIGTERM in any phase but a training batch: the job exits 75 (not 130 after the
    grace's SIGKILL) and, started again, resumes at the last step every worker backed up."""
    request = tmp_path / "sigterm.request"

    def job(*command):
        return [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
                "--grace_period=20", "--", sys.executable, *command, "--model=cnn", "--epochs=2",
                f"--steps_per_epoch={PHASE_STEPS}", f"--model_dir={tmp_path / 'run'}"]

    log = tmp_path / "preempted.out"
    with open(log, "w") as out:
        preempted = subprocess.Popen(job(f"{ROOT}/tests/workers/sigterm_at.py", phase, str(request)),
                                     env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        # In start-up, once both workers are there: a worker still importing TensorFlow has no
        # run yet, and dies of SIGTERM's default (130, the row of docs/keras.md before it).
        wanted = 2 if phase == "start-up" else 1
        while (len(request.read_text().split()) if request.exists() else 0) < wanted and \
                preempted.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        preempted.send_signal(signal.SIGTERM)  # The scheduler's.
        preempted.wait(timeout=120)
    finally:
        kill_left([preempted])
    output = log.read_text()
    assert f"{phase}: asked for SIGTERM" in output, output[-3000:]  # The fault happened, in that phase.
    assert preempted.returncode == 75, output[-3000:]
    saved = dict(re.findall(r"(worker:\d) preempted: (backed up step \d+|the backups are as they were)", output))
    last = 2 * PHASE_STEPS - (phase == "validation")  # In an epoch's end: the step before its last.
    expected = "the backups are as they were" if phase == "start-up" else f"backed up step {last}"
    assert expected in saved.values(), output[-3000:]
    resumed = _run_command(job("-m", "distrib_tf.train"))
    resumes = sorted(re.findall(r"(worker:\d) resumes at step (\d+)", resumed))
    if phase == "start-up":
        assert resumes == [], resumed[-3000:]
    else:  # Training was done (or all but the last epoch's last step and end): the restart ends it.
        assert resumes == [("worker:0", str(last)), ("worker:1", str(last))], resumed[-3000:]
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "serving").is_dir()


def _run_command(command):
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def test_sigterm_to_one_worker_in_validation_ends_every_worker_with_75(tmp_path):
    """Issue 33 item 7: one worker's SIGTERM outside the training batches ended that worker
    only (75), and its peer failed at its next collective (exit 1). Each task waits in the
    last validation; only the first to ask gets the SIGTERM (no launcher: real pids)."""
    from cluster_runner import local_spec  # pylint: disable=import-outside-toplevel

    request = tmp_path / "sigterm.request"
    spec = local_spec(2).with_free_ports()
    procs = [subprocess.Popen(
        [sys.executable, f"{ROOT}/tests/workers/sigterm_at.py", "validation", str(request), "--model=cnn",
         "--epochs=2", f"--steps_per_epoch={PHASE_STEPS}", f"--model_dir={tmp_path / 'run'}"],
        env={**ENV, "TF_CONFIG": spec.tf_config(task)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True) for task in spec.tasks]
    try:
        deadline = time.monotonic() + 180
        while not (request.exists() and request.read_text().strip()) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
            time.sleep(0.05)
        pid = int(request.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)  # One worker's: the scheduler evicted its host.
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        kill_left(procs)
    assert [p.returncode for p in procs] == [75, 75], [o[-2000:] for o in outputs]
    for output in outputs:  # The step before the epoch's last: the restart makes the epoch's end.
        assert re.search(rf"worker:\d preempted: backed up step {2 * PHASE_STEPS - 1} like every worker", output), (
            output[-2000:])


def test_a_sigterm_while_a_cpp_wait_fails_ends_every_worker_with_75(tmp_path):
    """Issue 42 item 3: a SIGTERM inside `saved()` raised `Preempted` from the signal handler
    into whatever the main thread was in; in a barrier that a departing peer made fail, it came
    out of TensorFlow's C++ call as `RuntimeError: pybind11::error_already_set: MISMATCH ...`,
    exit 1. Each worker here waits in a C++ call that fails 1 s after its SIGTERM."""
    from cluster_runner import local_spec  # pylint: disable=import-outside-toplevel
    from cluster_runner import run_cluster  # pylint: disable=import-outside-toplevel

    results = run_cluster([f"{ROOT}/tests/workers/sigterm_in_wait.py"], spec=local_spec(2),
                          env={"PYTHONPATH": ROOT}, timeout=120)
    for result in results:
        assert result.returncode == 75, (result.task, result.output[-2000:])
        assert f"{result.task} preempted: backed up step 5 like every worker" in result.output, result.output[-2000:]
        assert "raised into the wait" not in result.output
