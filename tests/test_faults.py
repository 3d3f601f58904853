"""Fault injection: workers killed at random moments, hosts cut off. Real jobs, real signals.

`make test` runs one trial of each; `make soak` runs `DISTRIB_TF_SOAK_TRIALS` (default
10) random kills and writes the figures to `DISTRIB_TF_SOAK_REPORT` if set.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import netns
from cluster_runner import QUIET_TF
from cluster_runner import latest_backup

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
EPOCHS = 3

pytestmark = pytest.mark.multiworker


def _read(out):
    out.seek(0)
    return out.read()


def kill_trial(tmp_path, rng: random.Random, timeout: float = 300) -> dict:
    """One 2-worker job through the launcher; SIGKILL a random worker at a random moment."""
    model_dir = tmp_path / "run"
    victim = rng.randrange(2)
    with open(tmp_path / "launcher.out", "w+") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
             "--max_restarts=2", "--grace_period=3", "--collective_timeout=20", "--",
             sys.executable, "-m", "distrib_tf.train", f"--epochs={EPOCHS}", "--steps_per_epoch=40",
             f"--model_dir={model_dir}"],
            env=ENV, stdout=out, stderr=subprocess.STDOUT)
        try:
            # Kill somewhere in epochs 1 to 3: before or after the first backup.
            time.sleep(rng.uniform(6.0, 14.0))
            text = _read(out)
            pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", text)]
            completed = len(re.findall(r"^\[worker:1\] worker:1 epoch \d+/", text, re.M))
            killed = len(pids) == 2 and proc.poll() is None
            if killed:
                os.kill(pids[victim], signal.SIGKILL)
            code = proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            proc.kill()
            code, hung = proc.wait(), True
        text = _read(out)
    trained = []
    if (model_dir / "summary.json").exists():
        trained = [e["epoch"] for e in json.loads((model_dir / "summary.json").read_text())["epochs"]]
    return {
        "victim": f"worker:{victim}",
        "killed": killed,
        "completed_before_kill": completed,
        "exit_code": code,
        "hung": hung,
        "restarted": "restarting the group" in text,
        "first_failure": "".join(re.findall(r"attempt 1: (.*) first;", text)),
        "epochs_after_restart": trained,
        # Whole epochs trained twice: those finished before the kill but not restored.
        "epochs_lost": max(completed - (trained[0] - 1), 0) if trained else None,
        "seconds": round(time.monotonic() - started, 1),
    }


def _check(trial):
    assert trial["killed"], trial  # The fault happened: the job was running when it struck.
    assert trial["restarted"] and f"{trial['victim']} was killed by SIGKILL" in trial["first_failure"], trial
    assert not trial["hung"] and trial["exit_code"] == 0, trial
    assert trial["epochs_after_restart"] and trial["epochs_after_restart"][-1] == EPOCHS, trial
    assert trial["epochs_lost"] <= 1, trial


def test_worker_killed_at_a_random_moment(tmp_path):
    seed = int(os.environ.get("DISTRIB_TF_FAULT_SEED", os.getpid()))
    print(f"random kill: seed {seed} (DISTRIB_TF_FAULT_SEED={seed} repeats it)", flush=True)
    _check(kill_trial(tmp_path, random.Random(seed)))


@pytest.mark.slow
def test_soak_random_kills(tmp_path):
    trials = int(os.environ.get("DISTRIB_TF_SOAK_TRIALS", "10"))
    rng = random.Random(int(os.environ.get("DISTRIB_TF_SOAK_SEED", "2026")))
    results = []
    for index in range(trials):
        trial_dir = tmp_path / f"trial{index}"
        trial_dir.mkdir()
        results.append(kill_trial(trial_dir, rng))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "trials": trials,
        "completed": sum(r["exit_code"] == 0 for r in results),
        "hangs": sum(r["hung"] for r in results),
        "max_epochs_lost": max((r["epochs_lost"] or 0) for r in results),
        "results": results,
    }
    if os.environ.get("DISTRIB_TF_SOAK_REPORT"):
        with open(os.environ["DISTRIB_TF_SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    for trial in results:
        _check(trial)


def test_host_cut_off_fails_within_the_timeout_and_comes_back(tmp_path):
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    model_dir = tmp_path / "run"
    with netns.two_hosts() as hosts:
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"cluster": {"worker": [f"{a}:23457" for _, a in hosts]}}))
        outs = [open(tmp_path / f"host{i}.out", "w+") for i in range(2)]
        procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={spec}",
                 "--max_restarts=4", "--grace_period=2", "--collective_timeout=5", "--",
                 sys.executable, "-m", "distrib_tf.train", "--epochs=4", "--steps_per_epoch=40",
                 f"--model_dir={model_dir}"],
                env=ENV, stdout=out, stderr=subprocess.STDOUT)
            for (name, _), out in zip(hosts, outs)
        ]
        try:
            deadline = time.monotonic() + 180
            while not latest_backup(model_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert latest_backup(model_dir), _read(outs[0])[-3000:]
            netns.set_link(hosts, up=False)
            cut = time.monotonic()
            while "first; restarting the group" not in _read(outs[0]) and time.monotonic() - cut < 60:
                time.sleep(0.2)
            noticed = time.monotonic() - cut
            netns.set_link(hosts, up=True)
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = [_read(out) for out in outs]
        for out in outs:
            out.close()
    print(f"host cut off: the launcher saw the failure {noticed:.1f} s after the cut", flush=True)
    assert noticed < 30, texts[0][-3000:]
    assert re.search(r"DeadlineExceeded|Collective has timed out|task:1|unhealthy", texts[0]), texts[0][-3000:]
    assert codes == [0, 0], [t[-2000:] for t in texts]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["epochs"][-1]["epoch"] == 4
