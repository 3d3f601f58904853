"""Fault injection: workers killed at random moments, hosts cut off. Real jobs, real signals.

`make test` runs one trial of the deterministic faults (a host cut off, a kill during a
backup's commit); `make soak` adds the random ones: a small soak (3 random faults,
SIGKILL or SIGTERM, its seed printed) and `DISTRIB_TF_SOAK_TRIALS` (default 10), writing
the figures to `DISTRIB_TF_SOAK_REPORT` if set. The kill and preemption paths they take
are tested one by one in `make test` (test_launch.py, test_preemption.py, test_train.py).
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import netns
from cluster_runner import QUIET_TF
from cluster_runner import finished_backups
from cluster_runner import kill_left
from cluster_runner import latest_backup
from cluster_runner import run_single

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
EPOCHS = 3

pytestmark = pytest.mark.multiworker


def _read(out):
    out.seek(0)
    return out.read()


BACKUP_EVERY = 10


def _launch(model_dir, out):
    return subprocess.Popen(
        [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
         "--max_restarts=2", "--grace_period=20", "--collective_timeout=20", "--",
         sys.executable, "-m", "distrib_tf.train", f"--epochs={EPOCHS}", "--steps_per_epoch=40",
         f"--backup_every_steps={BACKUP_EVERY}", f"--model_dir={model_dir}"],
        env=ENV, stdout=out, stderr=subprocess.STDOUT)


def fault_trial(tmp_path, rng: random.Random, sig: signal.Signals, timeout: float = 300) -> dict:
    """One 2-worker job through the launcher; a random worker gets SIGKILL or SIGTERM at a
    random moment. After a SIGTERM (exit 75, as on a preemption) the job is started again,
    as Slurm's requeue or Kubernetes would."""
    model_dir = tmp_path / "run"
    victim = rng.randrange(2)
    delay = rng.uniform(6.0, 14.0)
    started = time.monotonic()
    hung, held, codes = False, None, []
    with open(tmp_path / "launcher.out", "w+") as out:
        proc = _launch(model_dir, out)
        try:
            time.sleep(delay)  # Somewhere in epochs 1 to 3.
            pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", _read(out))]
            killed = len(pids) == 2 and proc.poll() is None
            if killed:
                held = latest_backup(model_dir, f"worker-{victim}")
                os.kill(pids[victim], sig)
            codes.append(proc.wait(timeout=timeout))
            if codes[-1] == 75:  # Preempted: every worker saved; start again.
                proc = _launch(model_dir, out)
                codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            hung = True
        text = _read(out)
    saved = [int(s) for s in re.findall(r"worker:\d preempted: backed up step (\d+)", text)]
    resumed = [int(s) for s in re.findall(r"worker:\d resumes at step (\d+)", text)]
    held_step = held["step"] if held else 0
    return {
        "signal": sig.name, "victim": f"worker:{victim}", "seconds_in": round(delay, 1),
        "killed": killed, "exit_codes": codes, "hung": hung,
        "first_failure": "".join(re.findall(r"attempt 1: (.*) first;", text)),
        "backup_held_at_kill": held_step, "saved_on_sigterm": saved, "resumed_at": resumed,
        # SIGTERM: steps between the agreed save and the resume (goal 0). SIGKILL: the resume
        # is the newest backup held when the kill struck (or a later one), so at most
        # BACKUP_EVERY - 1 steps are trained twice.
        "steps_lost": (max(saved) - min(resumed)) if saved and resumed else None,
        "seconds": round(time.monotonic() - started, 1),
    }


def _check(trial):
    assert trial["killed"], trial  # The fault happened: the job was running when it struck.
    assert not trial["hung"] and trial["exit_codes"][-1] == 0, trial
    if trial["signal"] == "SIGTERM":
        assert trial["exit_codes"] == [75, 0], trial
        assert len(set(trial["saved_on_sigterm"])) == 1 and trial["steps_lost"] == 0, trial
    else:
        assert f"{trial['victim']} was killed by SIGKILL" in trial["first_failure"], trial
        if trial["backup_held_at_kill"]:  # Resumed from that backup or a newer one, never from 0.
            assert trial["resumed_at"] and min(trial["resumed_at"]) >= trial["backup_held_at_kill"], trial


def _soak(tmp_path, trials: int, seed: int) -> dict:
    print(f"soak: {trials} trials, seed {seed} (DISTRIB_TF_SOAK_SEED={seed} repeats it)", flush=True)
    rng = random.Random(seed)
    results = []
    for index in range(trials):
        trial_dir = tmp_path / f"trial{index}"
        trial_dir.mkdir()
        # The first two are one of each; then either, at random.
        sig = [signal.SIGKILL, signal.SIGTERM][index] if index < 2 else rng.choice([signal.SIGKILL, signal.SIGTERM])
        results.append(fault_trial(trial_dir, rng, sig))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "command": f"DISTRIB_TF_SOAK_TRIALS={trials} DISTRIB_TF_SOAK_SEED={seed} make soak",
        "seed": seed, "trials": trials,
        "completed": sum(r["exit_codes"][-1:] == [0] for r in results),
        "hangs": sum(r["hung"] for r in results),
        "sigterm_steps_lost": [r["steps_lost"] for r in results if r["signal"] == "SIGTERM"],
        "sigkill_resumed_from_held_backup": [
            bool(r["resumed_at"]) and min(r["resumed_at"]) >= r["backup_held_at_kill"]
            for r in results if r["signal"] == "SIGKILL" and r["backup_held_at_kill"]],
        "results": results,
    }
    if os.environ.get("DISTRIB_TF_SOAK_REPORT"):
        with open(os.environ["DISTRIB_TF_SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    return report


@pytest.mark.slow
def test_small_soak_of_random_kills_and_preemptions(tmp_path):
    seed = int(os.environ.get("DISTRIB_TF_FAULT_SEED", os.getpid()))
    report = _soak(tmp_path, 3, seed)
    for trial in report["results"]:
        _check(trial)


@pytest.mark.slow
def test_soak_random_kills(tmp_path):
    report = _soak(tmp_path, int(os.environ.get("DISTRIB_TF_SOAK_TRIALS", "10")),
                   int(os.environ.get("DISTRIB_TF_SOAK_SEED", "2026")))
    for trial in report["results"]:
        _check(trial)


@pytest.mark.slow  # 47 s: make soak.
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
                 "--max_restarts=4", "--grace_period=2", "--collective_timeout=10", "--",
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
            kill_left(procs)
        texts = [_read(out) for out in outs]
        for out in outs:
            out.close()
    print(f"host cut off: the launcher saw the failure {noticed:.1f} s after the cut", flush=True)
    assert noticed < 30, texts[0][-3000:]
    assert re.search(r"DeadlineExceeded|Collective has timed out|task:1|unhealthy", texts[0]), texts[0][-3000:]
    assert codes == [0, 0], [t[-2000:] for t in texts]
    summary = json.loads((model_dir / "summary.json").read_text())
    # Finished: the last attempt trained up to epoch 4, or resumed at the very end (a
    # failure in the final evaluate, after the last backup, restarts there).
    assert (summary["epochs"] and summary["epochs"][-1]["epoch"] == 4) or summary["resumed_at_step"] == 4 * 40, summary


@pytest.mark.slow  # 23 to 29 s: make soak (tests/test_backup.py has torn writes in one process).
def test_sigkill_while_a_backup_is_written_leaves_one_that_restores(tmp_path):
    """strace holds the rename that commits step 6's backup; SIGKILL arrives during the hold."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("needs strace (Debian package strace; .ci/run installs it)")
    args = ["-m", "distrib_tf.train", "--epochs=1", "--steps_per_epoch=12", "--backup_every_steps=3"]
    reference = run_single([*args, f"--model_dir={tmp_path / 'uninterrupted'}"], env={"PYTHONPATH": ROOT}, timeout=300)
    assert reference.returncode == 0, reference.output[-3000:]
    model_dir = tmp_path / "run"
    backups = model_dir / "backup" / "chief-0"
    held = backups / "step-000000006.json.writing"
    renames = "rename,renameat,renameat2"
    proc = subprocess.Popen(
        [strace, "-f", "--seccomp-bpf", "-qq", "-P", str(held), "-e", f"trace={renames}",
         "-e", f"inject={renames}:delay_enter=120s", sys.executable, *args, f"--model_dir={model_dir}"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not held.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)  # Inside the held rename.
        assert proc.poll() is None, "the job ended before the held write"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # Killed between the weights' commit and the metadata's: step 6 is not a backup.
    assert held.exists() and (backups / "step-000000006.state").exists()
    assert not (backups / "step-000000006.json").exists()
    resumed = run_single([*args, f"--model_dir={model_dir}"], env={"PYTHONPATH": ROOT}, timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "chief:0 resumes at step 3 " in resumed.output
    fingerprint = re.compile(r"final weights sha256 (\w+)")
    assert fingerprint.findall(resumed.output) == fingerprint.findall(reference.output)


@pytest.mark.multiworker
@pytest.mark.slow  # 19 s: make soak.
def test_a_chief_killed_while_it_writes_its_outputs_leaves_a_job_that_finishes(tmp_path):
    """strace holds the rename that commits the chief's SavedModel (`serving/`, after
    `model.keras`, before `summary.json`); both workers are killed during the hold (the
    launcher's group restart). Every worker still holds its backup of the last step, so the
    restarted job resumes there and writes the outputs."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("needs strace (Debian package strace; .ci/run installs it)")
    from cluster_runner import local_spec  # pylint: disable=import-outside-toplevel
    from cluster_runner import run_cluster  # pylint: disable=import-outside-toplevel

    model_dir = tmp_path / "run"
    args = ["-m", "distrib_tf.train", "--epochs=1", "--steps_per_epoch=12", "--backup_every_steps=6",
            f"--model_dir={model_dir}"]
    spec = local_spec(2).with_free_ports()
    held = model_dir / ".partial.serving"
    renames = "rename,renameat,renameat2"
    procs = []
    for task in spec.tasks:
        hold = ([strace, "-f", "--seccomp-bpf", "-qq", "-P", str(held), "-e", f"trace={renames}",
                 "-e", f"inject={renames}:delay_enter=120s"] if task.index == 0 else [])
        procs.append(subprocess.Popen([*hold, sys.executable, *args], env={**ENV, "TF_CONFIG": spec.tf_config(task)},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        deadline = time.monotonic() + 240
        while not held.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.1)
        time.sleep(2.0)  # Inside the held rename.
        assert procs[0].poll() is None and held.exists(), "the chief ended before the held write"
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # worker:1 may have finished (and exited) already.
                pass
            proc.wait()
    assert (model_dir / "model.keras").exists() and not (model_dir / "summary.json").exists()
    again = run_cluster(args, spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=300)
    for result in again:
        assert result.returncode == 0, (result.task, result.output[-3000:])
        assert f"{result.task} resumes at step 12 " in result.output
    assert (model_dir / "summary.json").exists()
    assert finished_backups(model_dir) == {"worker-0": [(12, True)], "worker-1": [(12, True)]}
