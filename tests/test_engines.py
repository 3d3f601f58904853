"""Each Kubernetes engine's restart rules, played against real pods of the exports.

No API server runs here: `kube_pods` plays the engine over the pods of what
`distrib-tf-export` writes, each a local process in a network namespace of its own, and
the engine's documented rule decides what a pod's exit does (see that module).

Needs root and iproute2 (skips elsewhere; `DISTRIB_TF_REQUIRE_NETNS=1` fails instead).
`make test-engines` runs these (each a real two-worker training, minutes in all); the
rules themselves, per exit code, are in `test_export.py`.
"""

import contextlib
import csv
import glob
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
from distrib_tf import events
from distrib_tf import exit_codes
from kube_pods import ENGINES
from kube_pods import ROOT
from kube_pods import Cluster
from kube_pods import JobSetEngine

pytestmark = pytest.mark.engines


@pytest.fixture
def hosts():
    reason = netns.available()
    if reason:
        if os.environ.get("DISTRIB_TF_REQUIRE_NETNS"):
            pytest.fail(reason)
        pytest.skip(reason)
    with netns.two_hosts() as made:
        yield made


def _backups(volume, task):
    directory = os.path.join(volume, "cnn", "backup", task)
    try:
        return [int(m.group(1)) for n in os.listdir(directory) if (m := re.match(r"step-(\d+)\.json$", n))]
    except OSError:
        return []


def _summary(engine):
    chief = engine.pods[0].volume
    with open(os.path.join(chief, "cnn", "summary.json")) as f:
        return json.load(f)


def _logs(engine):
    texts = []
    for pod in engine.pods:
        with open(os.path.join(engine.base, f"pod{pod.index}.log")) as f:
            texts.append(f.read())
    return "\n".join(texts)


# What the engine does first when pod 1's container is killed (exit 137: an OOM kill, a
# lost node); its peer then fails on the dead peer (1) where the engine left it running.
CRASH = {
    "jobset": "RestartJobSet",  # Counted; every pod recreated, the survivor too.
    "trainjob": "RestartJobSet",
    "tfjob": "recreate_pod",  # 137 >= 128; the survivor's 1 comes as 129, retryable too.
    "job": "recreate_pod",  # Counted against backoffLimit (3 restarts x 2 pods).
}


@pytest.mark.parametrize("engine_name", CRASH)
def test_a_killed_pod_is_restarted_by_the_engines_rule_and_the_job_resumes(hosts, tmp_path, engine_name):
    engine = ENGINES[engine_name](str(tmp_path))
    cluster = Cluster(hosts, engine)
    killed = []

    def kill_pod_1_after_a_backup(_):
        steps = [step for step in _backups(engine.pods[1].volume, "worker-1") if step > 0]  # Not the start's.
        if steps:
            time.sleep(1.0)  # Into the next backup interval.
            killed.append(max(steps))
            engine.pods[1].proc.kill()
        return bool(killed)

    try:
        outcome = cluster.run(600, hook=kill_pod_1_after_a_backup)
    finally:
        cluster.close()
    assert killed, _logs(engine)[-3000:]
    assert outcome == "Succeeded", (engine.log, _logs(engine)[-5000:])
    assert engine.log[0] == (1, 137, CRASH[engine_name]), engine.log
    retryable = {"RestartJobSet", "recreate_pod"}
    assert all(action in retryable for _, _, action in engine.log), engine.log
    if engine_name == "tfjob":  # Every failure remapped to retryable: nothing under 128.
        assert all(code >= 128 for _, code, _ in engine.log), engine.log
    summary = _summary(engine)
    assert 0 < killed[0] <= summary["resumed_at_step"] < 60 and summary["epochs"][-1]["epoch"] == 2, (
        killed, summary)


@pytest.mark.parametrize("engine_name, expected", [
    ("jobset", (exit_codes.PREEMPTED, "RestartJobSetAndIgnoreMaxRestarts")),  # maxRestarts 0: not counted.
    ("tfjob", (128 + exit_codes.PREEMPTED, "recreate_pod")),
    ("job", (exit_codes.PREEMPTED, "recreate_pod")),  # Ignore: not counted, with backoffLimit 0.
])
def test_a_preemption_restarts_without_counting_and_resumes(hosts, tmp_path, engine_name, expected):
    engine = ENGINES[engine_name](str(tmp_path), "--max_restarts=0")
    cluster = Cluster(hosts, engine)
    preempted = []

    def drain_the_nodes(_):  # Each pod's container gets SIGTERM, as a node drain sends it.
        if any(step > 0 for step in _backups(engine.pods[1].volume, "worker-1")):
            preempted.append(True)
            for pod in engine.pods:
                pod.proc.send_signal(signal.SIGTERM)
        return bool(preempted)

    try:
        outcome = cluster.run(600, hook=drain_the_nodes)
    finally:
        cluster.close()
    assert outcome == "Succeeded", (engine.log, _logs(engine)[-5000:])
    assert engine.log and all(entry[1:] == expected for entry in engine.log), engine.log
    assert _summary(engine)["resumed_at_step"] > 0


@pytest.mark.parametrize("engine_name, expected", [
    ("jobset", "FailJobSet"), ("trainjob", "FailJobSet"), ("tfjob", "fail"), ("job", "fail")])
def test_a_bad_flag_fails_the_job_at_once(hosts, tmp_path, engine_name, expected):
    engine = ENGINES[engine_name](str(tmp_path))
    for pod in engine.pods:
        pod.command = [*pod.command, "--epochs=-1"]
    cluster = Cluster(hosts, engine)
    try:
        outcome = cluster.run(120)
    finally:
        cluster.close()
    assert outcome == "Failed", engine.log
    assert len(engine.log) == 1 and engine.log[0][1:] == (exit_codes.USAGE, expected), engine.log


def _backed_up(engine) -> bool:
    """Whether any pod's volume holds a backup past the start's, of any task."""
    for pod in engine.pods:
        tasks = os.path.join(pod.volume, "cnn", "backup")
        if any(step > 0 for task in (os.listdir(tasks) if os.path.isdir(tasks) else []) for step in
               _backups(pod.volume, task)):
            return True
    return False


SPECS = {1: "local_1worker.json", 2: "local_2workers.json"}


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_jobset_exported_again_at_another_size_resumes_from_the_same_claim(hosts, tmp_path, before, after):
    """Issue 32 on Kubernetes: a JobSet preempted (SIGTERM to each pod: 75 on each),
    deleted, and exported again with another number of workers over the same claim, each
    pod its own sub-path of it (its own disk) and its own network namespace. 2 -> 1: the one
    pod mounts the first pod's sub-path and resumes from worker:0's backups there. 1 -> 2: the
    second pod's sub-path is empty, and it gets the step and the state over the collective."""
    engine = JobSetEngine("jobset", str(tmp_path), f"--cluster_spec={ROOT}/cluster_specs/{SPECS[before]}")
    cluster = Cluster(hosts, engine)
    try:
        for pod in engine.pods:
            cluster.start(pod)
        deadline = time.monotonic() + 300
        while not _backed_up(engine):
            assert time.monotonic() < deadline and all(p.proc.poll() is None for p in engine.pods), _logs(engine)
            time.sleep(0.2)
        for pod in engine.pods:
            pod.proc.send_signal(signal.SIGTERM)
        codes = [pod.proc.wait(timeout=engine.grace + 30) for pod in engine.pods]
    finally:
        cluster.close()
    assert codes == [exit_codes.PREEMPTED] * before, (codes, _logs(engine)[-5000:])
    saved = set(re.findall(r"(?:chief|worker):\d preempted: backed up step (\d+)", _logs(engine)))
    assert len(saved) == 1, _logs(engine)[-5000:]
    step = int(saved.pop())
    resized = JobSetEngine("jobset", str(tmp_path), f"--cluster_spec={ROOT}/cluster_specs/{SPECS[after]}")
    assert len(resized.pods) == after and resized.pods[0].volume == engine.pods[0].volume
    cluster = Cluster(hosts, resized)
    try:
        outcome = cluster.run(600)
    finally:
        cluster.close()
    assert outcome == "Succeeded", (resized.log, _logs(resized)[-5000:])
    summary = _summary(resized)
    assert summary["workers"] == after and summary["resumed_at_step"] == step, summary
    if after > before:  # The new pod's disk was empty: its state came over the collective.
        assert "the state came from a worker that holds it" in _logs(resized), _logs(resized)[-5000:]


SWEPT = os.path.join(ROOT, "tests", "workers", "swept_script.py")  # A user's script a sweep runs.


def _kubectl(tmp_path) -> str:
    """A PATH whose `kubectl` is tests/kubectl.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT}/tests/kubectl.py "$@"\n')
    (bin_dir / "kubectl").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def _sweep_output(proc):
    out, _ = proc.communicate(timeout=900)
    return out


@contextlib.contextmanager
def _kubernetes_sweep(hosts, tmp_path, *flags):
    """`(args, env, sweep_dir, api)`: a sweep over the simulated API (tests/kubectl.py), its
    claim a directory mounted at the same path in the pods, its study a journal file there.
    Afterwards every Job's controller is stopped, and with it its pods."""
    claim, api = tmp_path / "claim", tmp_path / "api"
    claim.mkdir()
    api.mkdir()
    env = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT, "DISTRIB_TF_KUBE_API": str(api),
           "DISTRIB_TF_KUBE_HOSTS": json.dumps(hosts), "DISTRIB_TF_KUBE_CLAIMS": "runs", "PATH": _kubectl(tmp_path)}
    sweep_dir = claim / "sweep"
    args = [sys.executable, "-m", "distrib_tf.experiments.sweep", "--engine=kubernetes",
            "--image=registry.example/job:1", "--volume_claim=runs", f"--claim_mount={claim}",
            "--workers_per_trial=2", f"--storage=journal:{claim / 'study.log'}", f"--sweep_dir={sweep_dir}",
            "--metric=val_loss", "--mode=min", *flags]
    try:
        yield args, env, sweep_dir, api
    finally:
        for pid_file in glob.glob(f"{api}/*/controller.pid"):  # Ours: each Job's controller, and its pods.
            with open(pid_file) as f:
                pid = int(f.read())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def _after_the_first_epoch(proc, sweep_dir) -> str:
    """Waits until the first trial's chief ended an epoch: that trial's `events.jsonl`."""
    deadline = time.monotonic() + 300
    while not (found := glob.glob(f"{sweep_dir}/trial-*/events.jsonl")):
        assert time.monotonic() < deadline and proc.poll() is None, _sweep_output(proc)[-5000:]
        time.sleep(0.2)
    while not any(e["event"] == "epoch" for e in events.read(found[0])):
        assert time.monotonic() < deadline and proc.poll() is None, _sweep_output(proc)[-5000:]
        time.sleep(0.2)
    return found[0]


def test_a_sweep_of_two_trials_as_kubernetes_jobs_prunes_one(hosts, tmp_path):
    """Issue 52 item 1 on Kubernetes: `distrib-tf-sweep --engine=kubernetes`, each trial an
    Indexed Job of 2 pods (one per simulated node) created through `kubectl` (tests/kubectl.py
    plays the API: the Job's rules over real pods), the claim mounted at the same path in the
    pods as in the sweep's, the study a journal file on it. The sweep is SIGKILLed after the
    first trial's first epoch: its Job goes on (it is the cluster's), and the same command
    follows it again. The grid's second trial (a learning rate of 0) is pruned after its first
    epoch by the median of the first, on both pods, through the study; its Job fails at once
    on exit 3 (a FailJob rule), so no pod is retried, and no trial runs twice."""
    flags = ("--space=learning_rate=[0.05,0.0]", "--pruner=median", "--pruner_startup_trials=1", "--", "python",
             SWEPT, "--epochs=2")
    with _kubernetes_sweep(hosts, tmp_path, *flags) as (args, env, sweep_dir, api):
        def sweep():
            return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        killed = sweep()
        _after_the_first_epoch(killed, sweep_dir)
        killed.kill()
        _sweep_output(killed)
        output = _sweep_output(sweep())
    assert re.search(r"trial 0 \{'learning_rate': 0.05\}: its job kubernetes:\S+ followed again", output), (
        output[-5000:])
    assert "sweep: 2/2 ended (1 pruned, 0 failed)" in output, output[-5000:]
    with open(sweep_dir / "results.csv", encoding="utf-8") as f:
        rows = {float(row["learning_rate"]): row for row in csv.DictReader(f)}
    assert {k: (r["status"], r["epochs"]) for k, r in rows.items()} == {
        0.05: ("finished", "2"), 0.0: ("pruned", "1")}, output[-5000:]
    controllers = {}
    for log in glob.glob(f"{api}/*/controller.log"):
        with open(log) as f:
            controllers[os.path.basename(os.path.dirname(log))] = f.read()
    assert len(controllers) == 2, controllers  # One Job per trial, each applied once.
    pruned_dir = rows[0.0]["model_dir"]
    for task in ("worker_0", "worker_1"):  # Both pods, at one step, with the pruned code, not retried.
        with open(os.path.join(pruned_dir, f"{task}.log"), encoding="utf-8") as f:
            text = f.read()
        assert f"{task.replace('_', ':')} pruned by the sweep after epoch 1: backed up step 16 like every worker" in (
            text), text[-3000:]
    with open(os.path.join(pruned_dir, "trial.log"), encoding="utf-8") as f:
        pods = f.read()  # The pods' output, collected once the Job ended.
    assert re.search(r"\[pod/\S+-1-\w{5}/task\] \[worker:1\] worker:1 pruned by the sweep", pods), pods[-3000:]
    outcomes = sorted(text.strip().splitlines()[-1] for text in controllers.values())
    assert outcomes[0].startswith("Failed: [(") and outcomes[1].startswith("Succeeded: []"), outcomes
    assert re.fullmatch(r"Failed: \[\(\d, 3, 'fail'\)\]", outcomes[0]), outcomes  # Exit 3: FailJob, once.
    with open(os.path.join(rows[0.05]["model_dir"], "worker_0.log"), encoding="utf-8") as f:
        finished = f.read()
    assert "resumes at step" not in finished, finished[-3000:]  # One Job, once, never restarted.


@pytest.mark.parametrize("flags, message", [
    (["--image=i"], "Invalid value for `--engine`. Received: kubernetes, but no kubectl on PATH."),
    (["--volume_claim=runs"], "Missing `--image` for --engine=kubernetes."),
    (["--image=i"], "Missing `--volume_claim` for --engine=kubernetes."),
    (["--image=i", "--volume_claim=Runs_1"], "Invalid value for `--volume_claim`. Received: Runs_1. Expected a "
                                             "PersistentVolumeClaim's name"),
    (["--image=i", "--volume_claim=other"], "Invalid value for `--volume_claim`. Received: other (kubectl: Error from "
                                            'server (NotFound): persistentvolumeclaims "other" not found).'),
    (["--image=i", "--volume_claim=runs", "--claim_mount=runs"], "Invalid value for `--claim_mount`. Received: runs."),
    (["--image=i", "--volume_claim=runs", "--claim_mount={claim}", "--storage=journal:{claim}/study.log"],
     "Invalid value for `--sweep_dir` with --engine=kubernetes. Received: {sweep}. Expected a path under "
     "--claim_mount={claim}"),
    (["--image=i", "--volume_claim=runs", "--claim_mount={claim}", "--sweep_dir={claim}/sweep",
      "--storage=journal:{sweep}.log"],
     "Invalid value for `--storage` with --engine=kubernetes. Received: {sweep}.log."),
    (["--image=i", "--volume_claim=runs", "--claim_mount={claim}", "--sweep_dir={claim}/sweep"],
     "Invalid value for `--storage`. Received: sqlite:///{claim}/sweep/study.db (the default) with "
     "--engine=kubernetes."),
])
def test_a_kubernetes_sweep_refuses_what_its_pods_could_not_use_in_one_line(tmp_path, flags, message):
    claim, sweep_dir = tmp_path / "claim", tmp_path / "sweep"
    claim.mkdir()
    path = os.path.dirname(sys.executable) if "no kubectl" in message else _kubectl(tmp_path)
    names = {"claim": claim, "sweep": sweep_dir}
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.experiments.sweep", "--engine=kubernetes", f"--sweep_dir={sweep_dir}",
         "--space=units=[4]", *(flag.format(**names) for flag in flags), "--", "python", SWEPT],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT, "PATH": path,
                                             "DISTRIB_TF_KUBE_CLAIMS": "runs"}, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and message.format(**names) in result.stderr, result.stderr
    assert not sweep_dir.exists() and not (claim / "sweep").exists()  # Nothing started.


def test_a_sigterm_to_a_kubernetes_sweep_deletes_its_job_and_the_same_command_resumes_the_trial(hosts, tmp_path):
    """Ctrl-C or SIGTERM to the sweep: `kubectl delete --cascade=foreground` of the running
    trial's Job, each pod SIGTERMed, every worker backs up one agreed step and exits 75, and
    the sweep, once the Job is gone, exits 75 itself; the same command creates the trial's Job anew
    and both pods resume at that step."""
    flags = ("--space=learning_rate=[0.05]", "--", "python", SWEPT, "--epochs=8")
    with _kubernetes_sweep(hosts, tmp_path, *flags) as (args, env, sweep_dir, api):
        stopped = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = _after_the_first_epoch(stopped, sweep_dir)
        stopped.send_signal(signal.SIGTERM)
        first = _sweep_output(stopped)
        assert stopped.returncode == exit_codes.PREEMPTED, first[-5000:]
        second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0 and "sweep: 1/1 ended (0 pruned, 0 failed)" in second.stdout, (
        second.stdout[-5000:] + second.stderr[-3000:])
    trial_dir = os.path.dirname(found)
    steps = set()
    for task in ("worker_0", "worker_1"):
        with open(os.path.join(trial_dir, f"{task}.log"), encoding="utf-8") as f:
            text = f.read()
        saved = re.findall(rf"{task.replace('_', ':')} preempted: backed up step (\d+) like every worker", text)
        resumed = re.findall(rf"{task.replace('_', ':')} resumes at step (\d+)", text)
        assert len(saved) >= 1 and resumed == saved[-1:], text[-3000:]
        steps.add(int(resumed[0]))
    assert len(steps) == 1 and 0 < steps.pop() < 8 * 16, first[-3000:]  # One agreed step, inside the run.
    with open(os.path.join(trial_dir, "summary.json")) as f:
        assert json.load(f)["epochs"][-1]["epoch"] == 8
    controllers = []
    for log in glob.glob(f"{api}/*/controller.log"):
        with open(log) as f:
            controllers.append(f.read().strip().splitlines()[-1])
    controllers.sort()
    assert len(controllers) == 2 and controllers[0].startswith("Succeeded") and controllers[1].startswith(
        "deleted"), controllers  # The first Job deleted, the second applied anew.
