"""Each Kubernetes engine's restart rules, played against real pods of the exports.

No API server runs here, so this plays the engine: each pod of what `distrib-tf-export`
writes runs as a local process in a network namespace of its own (the pod's IP), its
DNS name in that namespace's hosts file (`ip netns exec` mounts
`/etc/netns/NAME/hosts`), its volume a directory (the claim, or the claim's sub-path of
that pod), the container's command and environment as the engine would give them
(`$(JOB_COMPLETION_INDEX)`; the Training Operator's `TF_CONFIG`). When a pod ends, the
engine's documented rule, taken from its code, decides:

- Job (`batch/v1`, pkg/controller/job): the first `podFailurePolicy` rule that matches
  (`Ignore`: recreate the pod, not counted; `FailJob`); else the failure counts, and past
  `backoffLimit` the Job fails; else the pod is recreated.
- JobSet 0.12 (pkg/controllers/failure_policy.go): the Job fails as above (its
  `backoffLimit` is 0); the first JobSet rule whose reasons and message patterns match
  acts; none: `RestartJobSet`, counted against `maxRestarts`. A restart deletes every
  pod (SIGTERM, then SIGKILL after the grace period) and creates them all again. A
  TrainJob's JobSet is the same.
- TFJob 1.9 (`ExitCode`, pkg/controller.v1/common/pod.go): exit code 128 or more
  recreates that pod; 1 to 127 fails the TFJob.

Needs root and iproute2 (skips elsewhere; `DISTRIB_TF_REQUIRE_NETNS=1` fails instead).
`make test-engines` runs these (each a real two-worker training, minutes in all); the
rules themselves, per exit code, are in `test_export.py`.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

import netns
from cluster_runner import QUIET_TF
from distrib_tf import exit_codes

pytestmark = pytest.mark.engines

ROOT = os.path.dirname(os.path.dirname(__file__))
BIN = os.path.dirname(sys.executable)  # distrib-tf-launch, as in the image.
NAME = "dtf"
JOB_FLAGS = ["python", "-m", "distrib_tf.train", "--epochs=2", "--steps_per_epoch=30",
             "--backup_every_steps=5", "--collective_timeout=20", "--model_dir=/runs/cnn"]


@dataclasses.dataclass
class Pod:
    index: int
    hostname: str  # Its DNS name, as the engine's headless service gives it.
    command: list
    env: dict
    volume: str  # What the engine mounts at /runs for it.
    proc: subprocess.Popen | None = None


def _export(engine, *options):
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.deploy", "kubernetes", f"--engine={engine}",
         f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json", f"--name={NAME}",
         "--image=registry.example/job:1", "--volume_claim=runs", *options, "--", *JOB_FLAGS],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=30)
    assert result.returncode == 0, result.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(result.stdout)}


class Engine:
    """Plays one engine's rules over the pods of its manifests (see the module docstring)."""

    def __init__(self, engine, base, *options):
        self.manifests = _export(engine, *options)
        self.base = base
        self.log = []  # What the engine did, in order: the test's record.

    def _substitute(self, command, pod_env, volume, spec_file=None):
        out = []
        for arg in command:
            for key, value in pod_env.items():
                arg = arg.replace(f"$({key})", value)
            if spec_file and arg == "--cluster_spec=/etc/distrib_tf/spec.json":
                arg = f"--cluster_spec={spec_file}"
            out.append(arg.replace("/runs", volume))
        return out


class JobSetEngine(Engine):
    def __init__(self, engine, base, *options):
        super().__init__(engine, base, *options)
        body = (self.manifests["JobSet"]["spec"] if "JobSet" in self.manifests
                else self.manifests["TrainingRuntime"]["spec"]["template"]["spec"])
        self.policy = body["failurePolicy"]
        replicated = body["replicatedJobs"][0]
        self.job = replicated["template"]["spec"]
        self.container = self.job["template"]["spec"]["containers"][0]
        self.grace = self.job["template"]["spec"]["terminationGracePeriodSeconds"]
        self.restarts = 0
        spec_file = os.path.join(base, "spec.json")
        with open(spec_file, "w") as f:
            f.write(self.manifests["ConfigMap"]["data"]["spec.json"])
        self.pods = []
        for i in range(self.job["completions"]):
            env = {"JOB_COMPLETION_INDEX": str(i)}
            mount = next(m for m in self.container["volumeMounts"] if m["name"] == "runs")
            volume = os.path.join(base, "claim", mount.get("subPathExpr", "").replace(
                "$(JOB_COMPLETION_INDEX)", str(i)))
            self.pods.append(Pod(i, f"{NAME}-{replicated['name']}-0-{i}.{NAME}",
                                 self._substitute(self.container["command"], env, volume, spec_file), env, volume))

    def on_exit(self, pod, code):
        """The Job fails at once (podFailurePolicy, or backoffLimit 0); the JobSet's rules act."""
        for index, rule in enumerate(self.job["podFailurePolicy"]["rules"]):
            on_exit = rule.get("onExitCodes")
            if on_exit and (code in on_exit["values"]) == (on_exit["operator"] == "In"):
                assert rule["action"] == "FailJob"
                reason = "PodFailurePolicy"
                message = (f"Container {self.container['name']} for pod default/{pod.hostname} failed "
                           f"with exit code {code} matching FailJob rule at index {index}")
                break
        else:
            assert self.job["backoffLimit"] == 0
            reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        action = "RestartJobSet"
        for rule in self.policy["rules"]:
            if reason in rule.get("onJobFailureReasons", [reason]) and any(
                    re.search(p, message) for p in rule.get("onJobFailureMessagePatterns", ["."])):
                action = rule["action"]
                break
        if action == "RestartJobSet":
            if self.restarts >= self.policy["maxRestarts"]:
                action = "FailJobSet"
            else:
                self.restarts += 1
        self.log.append((pod.index, code, action))
        return {"FailJobSet": "fail"}.get(action, "restart_all")


class TFJobEngine(Engine):
    def __init__(self, base, *options):
        super().__init__("tfjob", base, *options)
        replica = self.manifests["TFJob"]["spec"]["tfReplicaSpecs"]["Worker"]
        container = replica["template"]["spec"]["containers"][0]
        port = container["ports"][0]["containerPort"]
        self.grace = replica["template"]["spec"]["terminationGracePeriodSeconds"]
        hostnames = [f"{NAME}-worker-{i}.default.svc" for i in range(replica["replicas"])]
        self.pods = []
        for i, hostname in enumerate(hostnames):
            # The operator's TF_CONFIG (pkg/controller.v1/tensorflow/tensorflow.go, genTFConfigJSONStr).
            tf_config = {"cluster": {"worker": [f"{h}:{port}" for h in hostnames]},
                         "task": {"type": "worker", "index": i}, "environment": "cloud"}
            env = {"POD_NAME": f"{NAME}-worker-{i}", "TF_CONFIG": json.dumps(tf_config)}
            volume = os.path.join(base, "claim", env["POD_NAME"])  # subPathExpr: $(POD_NAME).
            self.pods.append(Pod(i, hostname, self._substitute(container["command"], env, volume), env, volume))

    def on_exit(self, pod, code):
        action = "recreate_pod" if code >= 128 else "fail"  # IsRetryableExitCode.
        self.log.append((pod.index, code, action))
        return action


class JobEngine(Engine):
    def __init__(self, base, *options):
        super().__init__("job", base, *options)
        self.job = self.manifests["Job"]["spec"]
        container = self.job["template"]["spec"]["containers"][0]
        self.grace = self.job["template"]["spec"]["terminationGracePeriodSeconds"]
        self.failures = 0
        spec_file = os.path.join(base, "spec.json")
        with open(spec_file, "w") as f:
            f.write(self.manifests["ConfigMap"]["data"]["spec.json"])
        volume = os.path.join(base, "claim")  # One claim, shared.
        self.pods = [Pod(i, f"{NAME}-{i}.{NAME}", self._substitute(
            container["command"], {"JOB_COMPLETION_INDEX": str(i)}, volume, spec_file),
            {"JOB_COMPLETION_INDEX": str(i)}, volume) for i in range(self.job["completions"])]

    def on_exit(self, pod, code):
        for rule in self.job["podFailurePolicy"]["rules"]:
            on_exit = rule.get("onExitCodes")
            if on_exit and (code in on_exit["values"]) == (on_exit["operator"] == "In"):
                action = {"Ignore": "recreate_pod", "FailJob": "fail"}[rule["action"]]
                break
        else:
            self.failures += 1
            action = "fail" if self.failures > self.job["backoffLimit"] else "recreate_pod"
        self.log.append((pod.index, code, action))
        return action


ENGINES = {
    "jobset": lambda base, *o: JobSetEngine("jobset", base, *o),
    "trainjob": lambda base, *o: JobSetEngine("trainjob", base, *o),
    "tfjob": TFJobEngine,
    "job": JobEngine,
}


class Cluster:
    """The pods' network: a namespace per pod, the DNS names in each one's hosts file."""

    def __init__(self, hosts, engine):
        self.hosts, self.engine = hosts, engine
        lines = "".join(f"{address} {pod.hostname}\n" for pod, (_, address) in zip(engine.pods, hosts))
        for name, _ in hosts:
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + lines)
        self.outputs = {pod.index: open(os.path.join(engine.base, f"pod{pod.index}.log"), "a")
                        for pod in engine.pods}

    def close(self):
        for pod in self.engine.pods:
            if pod.proc and pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait()
        for out in self.outputs.values():
            out.close()
        for name, _ in self.hosts:
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)

    def start(self, pod):
        env = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT, "PATH": f"{BIN}:{os.environ['PATH']}", **pod.env}
        pod.proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[pod.index][0], *pod.command],
                                    env=env, stdout=self.outputs[pod.index], stderr=subprocess.STDOUT)

    def delete_all(self):
        """What deleting a pod does: SIGTERM, then SIGKILL after the grace period."""
        alive = [p for p in self.engine.pods if p.proc.poll() is None]
        for pod in alive:
            pod.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.engine.grace
        for pod in alive:
            try:
                pod.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                pod.proc.wait()

    def run(self, deadline_seconds, *, hook=None):
        """Plays the engine until the job succeeds or fails: `"Succeeded"` or `"Failed"`.
        `hook(self)`, until it returns True, is called on every pass (a fault to inject)."""
        for pod in self.engine.pods:
            self.start(pod)
        succeeded = set()
        deadline = time.monotonic() + deadline_seconds
        while time.monotonic() < deadline:
            if hook and hook(self):
                hook = None
            for pod in self.engine.pods:
                code = pod.proc.poll()
                if code is None or pod.index in succeeded:
                    continue
                code = 128 - code if code < 0 else code  # A container killed by a signal.
                if code == exit_codes.OK:
                    succeeded.add(pod.index)
                    continue
                action = self.engine.on_exit(pod, code)
                if action == "fail":
                    self.delete_all()
                    return "Failed"
                if action == "recreate_pod":
                    self.start(pod)
                else:  # restart_all
                    self.delete_all()
                    succeeded.clear()
                    for each in self.engine.pods:
                        self.start(each)
                    break
            if len(succeeded) == len(self.engine.pods):
                return "Succeeded"
            time.sleep(0.2)
        raise AssertionError(f"the job did not end in {deadline_seconds} s: {self.engine.log}")


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
