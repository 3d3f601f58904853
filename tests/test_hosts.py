"""Several hosts as they are: each with its own disk, and a side-car evaluator.

The own-disk test needs root (network and mount namespaces); it skips elsewhere, saying
why, and `.ci/run` makes it required (`DISTRIB_TF_REQUIRE_NETNS=1`).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import netns
from cluster_runner import QUIET_TF
from cluster_runner import kill_left

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
TRAIN = [sys.executable, "-m", "distrib_tf.train"]
LAUNCH = [sys.executable, "-m", "distrib_tf.launch"]

pytestmark = pytest.mark.multiworker


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _wait_for(path, pattern, timeout, procs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        match = re.search(pattern, _read(path), re.M)
        if match:
            return match
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} did not appear in {timeout} s:\n{_read(path)[-3000:]}")


@pytest.mark.slow  # 40 s: make soak; make test's own-disk cases are tests/test_run.py's (mount namespaces).
def test_hosts_with_their_own_disks_resume_from_one_point(tmp_path):
    reason = netns.available()
    if reason:
        if os.environ.get("DISTRIB_TF_REQUIRE_NETNS"):
            pytest.fail(reason)
        pytest.skip(reason)
    model_dir = tmp_path / "run"  # Each host mounts its own tmpfs here: nothing is shared.
    model_dir.mkdir()
    with netns.two_hosts() as hosts:
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"cluster": {"worker": [f"{a}:23461" for _, a in hosts]}}))
        command = [*LAUNCH, f"--cluster_spec={spec}", "--max_restarts=2", "--grace_period=3",
                   "--collective_timeout=20", "--", *TRAIN, "--epochs=4", "--steps_per_epoch=60",
                   "--backup_every_steps=10", f"--model_dir={model_dir}"]
        script = f'mount -t tmpfs tmpfs {model_dir} && exec "$@"'
        logs = [tmp_path / f"host{i}.out" for i in range(2)]
        procs = []
        for (name, _), log in zip(hosts, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", name, "unshare", "--mount", "--propagation", "private",
                     "bash", "-c", script, "bash", *command], env=ENV, stdout=out, stderr=subprocess.STDOUT))
        try:
            pid = int(_wait_for(logs[1], r"started worker:1 \(pid (\d+)\)", 60, procs).group(1))
            _wait_for(logs[1], r"worker:1 epoch 2/4", 240, procs)
            # Early in epoch 3 (it began with the line; backed up at 120, then every 10 steps).
            # With 30-step epochs a 1.5 s wait once reached the epoch's end (resumed at 90).
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            codes = [p.wait(timeout=400) for p in procs]
        finally:
            kill_left(procs)
        texts = [_read(log) for log in logs]
    assert codes == [0, 0], [t[-3000:] for t in texts]
    assert "worker:1 was killed by SIGKILL" in texts[1], texts[1][-3000:]
    resumed = [re.findall(r"worker:\d resumes at step (\d+)", text) for text in texts]
    assert resumed[0] and resumed[0] == resumed[1], resumed  # Same point on both hosts.
    step = int(resumed[1][0])
    assert 120 <= step < 180, step  # Not from zero: at most one backup interval lost.
    # After the restart neither host trains an epoch that was done before the kill.
    for text in texts:
        after = text[text.index("resumes at step"):]
        assert not re.search(r"[Ee]poch [12]/4", after), after[-3000:]
    fingerprints = [re.findall(r"worker:\d final weights sha256 (\w+)", text) for text in texts]
    assert fingerprints[0] and fingerprints[0] == fingerprints[1], fingerprints
    print(f"own disks: worker:1 killed; both hosts resumed at step {step} of 240; "
          f"{time.monotonic() - killed:.1f} s from kill to the end of the job", flush=True)


@pytest.mark.slow  # 24 s: make soak (tests/test_evaluator.py runs in make test).
def test_evaluator_follows_the_chiefs_checkpoints(tmp_path):
    model_dir = tmp_path / "run"
    result = subprocess.run(
        [*LAUNCH, f"--cluster_spec={ROOT}/cluster_specs/local_evaluator.json", "--",
         *TRAIN, "--epochs=2", "--steps_per_epoch=8", "--global_batch_size=48", f"--model_dir={model_dir}"],
        env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "started evaluator:0" in result.stdout
    summary = json.loads((model_dir / "summary.json").read_text())
    evaluated = json.loads((model_dir / "eval" / "eval.json").read_text())["checkpoints"]
    assert [e["epoch"] for e in evaluated] == [1, 2]
    assert summary["workers"] == 3 and summary["replicas"] == 3  # The evaluator trained nothing.
    for name, value in summary["final"].items():
        assert evaluated[-1][name] == pytest.approx(value, rel=1e-4), (name, evaluated[-1], summary["final"])
    # The chief's outputs, and the evaluator's in eval/ only.
    assert sorted(os.listdir(model_dir)) == ["backup", "checkpoints", "eval", "logs", "model.keras", "serving",
                                             "summary.json"]
    assert sorted(os.listdir(model_dir / "backup")) == ["chief-0", "worker-0", "worker-1"]  # No evaluator.
    assert sorted(os.listdir(model_dir / "checkpoints")) == [
        "epoch001.json", "epoch001.weights.h5", "epoch002.json", "epoch002.weights.h5"]
    eval_files = os.listdir(model_dir / "eval")
    assert "eval.json" in eval_files and all(f == "eval.json" or f.startswith("events.out.tfevents")
                                             for f in eval_files), eval_files
