"""Preemptions at random moments: a job that saved exits 75 every time, and says so.

Seen by hand once in 7 (issue 33): both workers printed `preempted: backed up step 63`, the
launcher exited 130. A preempted worker then left through the interpreter's teardown, which
could outlast the grace and end by SIGKILL; now it leaves at once (`distrib_tf.run.ending`),
and the launcher exits 75 only when every task did, else names each task's code.
`make test` runs a few; `make soak` 50 (`DISTRIB_TF_PREEMPTIONS`, seed `DISTRIB_TF_PREEMPT_SEED`,
figures written to `DISTRIB_TF_SOAK_REPORT`'s folder as `preemptions.json`).
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

from cluster_runner import QUIET_TF
from cluster_runner import kill_left

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}

pytestmark = pytest.mark.multiworker


def preempt_once(model_dir, delay: float) -> dict:
    """Starts a 2-worker main job, SIGTERMs its launcher `delay` s after both tasks started."""
    command = [sys.executable, "-m", "distrib_tf.launch", "--workers=2", "--grace_period=20", "--",
               sys.executable, "-m", "distrib_tf.train", "--epochs=3", "--steps_per_epoch=40",
               "--backup_every_steps=10", f"--model_dir={model_dir}"]
    log = model_dir.parent / f"{model_dir.name}.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "started worker:1" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        kill_left([proc])
    text = log.read_text()
    saved = re.findall(r"(worker:\d) preempted: (backed up step \d+|the backups are as they were)", text)
    return {"delay": round(delay, 2), "exit_code": code, "saved": saved,
            "finished_first": "every task succeeded" in text, "launcher": re.findall(r"\[launcher\] .*", text)[-1:]}


def _check(trial):
    if trial["finished_first"]:
        assert trial["exit_code"] == 0, trial
        return
    if not trial["saved"] and all(line.count("was killed by SIGTERM") == 2 for line in trial["launcher"]):
        # Both tasks still starting their interpreters and imports, before any run: SIGTERM's
        # default, 130, nothing trained (docs/keras.md's row for a SIGTERM before the run).
        assert trial["exit_code"] == 130 and trial["launcher"], trial
        return
    assert trial["exit_code"] == 75, trial  # Never 130 for a job whose every worker saved.
    # A worker still importing when the SIGTERM came, beside one that saved: nothing to save.
    unstarted = re.search(r"\(([^()]*): stopped before its run started, nothing to save\)", trial["launcher"][0])
    unstarted = unstarted.group(1).split(", ") if unstarted else []
    assert sorted([task for task, _ in trial["saved"]] + unstarted) == ["worker:0", "worker:1"], trial
    assert len({how for _, how in trial["saved"]}) == 1, trial  # One step, agreed.


def _trials(tmp_path, count: int, seed: int, *, span: float = 24) -> list[dict]:
    print(f"preemptions: {count}, seed {seed} (DISTRIB_TF_PREEMPT_SEED={seed} repeats the moments)", flush=True)
    rng = random.Random(seed)
    results = []
    for index in range(count):
        # Every other one in the first 2 s: start-up, where CI once saw worker:1 leave with 75 while
        # worker:0 waited on for it inside the strategy (SIGKILL after the grace, 130); the others
        # over the whole run (about 20 s here), its final evaluate, export and last barriers
        # included (issue 42 item 3: a SIGTERM in a barrier exited 1), or after its end.
        delay = rng.uniform(0, span) if index % 2 else rng.uniform(0, 2)
        results.append(preempt_once(tmp_path / f"run{index}", delay))
        print(json.dumps(results[-1]), flush=True)
    return results


def test_preemptions_at_random_moments_exit_75(tmp_path):
    for trial in _trials(tmp_path, 2, int(os.environ.get("DISTRIB_TF_PREEMPT_SEED", os.getpid())), span=14):
        _check(trial)


@pytest.mark.slow
def test_soak_of_preemptions_at_random_moments(tmp_path):
    count = int(os.environ.get("DISTRIB_TF_PREEMPTIONS", "50"))
    results = _trials(tmp_path, count, int(os.environ.get("DISTRIB_TF_PREEMPT_SEED", "2026")))
    if os.environ.get("DISTRIB_TF_SOAK_REPORT"):
        path = os.path.join(os.path.dirname(os.path.abspath(os.environ["DISTRIB_TF_SOAK_REPORT"])),
                            "preemptions.json")
        with open(path, "w") as f:
            json.dump({"trials": count, "exit_codes": [r["exit_code"] for r in results], "results": results}, f,
                      indent=2)
    codes = [r["exit_code"] for r in results]
    print(f"preemptions: {codes.count(75)} of {count} exited 75, {codes.count(0)} had finished first, "
          f"others: {[c for c in codes if c not in (0, 75)]}", flush=True)
    for trial in results:
        _check(trial)
