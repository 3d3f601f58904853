"""Kubernetes's engines played over real pods: each pod a local process in a network namespace.

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

`tests/test_engines.py` plays the exports with it; `tests/kubectl.py` plays a Job that a
sweep applies through `kubectl`.
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

import yaml

from cluster_runner import QUIET_TF
from distrib_tf import exit_codes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

    def __init__(self, engine, base, *options, manifests=None):
        self.manifests = manifests or _export(engine, *options)
        self.base = base
        self.log = []  # What the engine did, in order: the test's record.

    def _substitute(self, command, pod_env, volume, spec_file=None, mount="/runs"):
        out = []
        for arg in command:
            for key, value in pod_env.items():
                arg = arg.replace(f"$({key})", value)
            if spec_file and arg == "--cluster_spec=/etc/distrib_tf/spec.json":
                arg = f"--cluster_spec={spec_file}"
            out.append(arg.replace(mount, volume))
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
    """An Indexed Job: the exported one, or `manifests` as `kubectl apply` got them, whose
    claim, mounted elsewhere than `/runs`, is that same path here (a sweep's trial)."""

    def __init__(self, base, *options, manifests=None):
        super().__init__("job", base, *options, manifests=manifests)
        self.name = self.manifests["Job"]["metadata"]["name"]
        self.job = self.manifests["Job"]["spec"]
        self.container = container = self.job["template"]["spec"]["containers"][0]
        self.grace = self.job["template"]["spec"]["terminationGracePeriodSeconds"]
        self.failures = 0
        self.failure = None  # Once failed: the Job's `Failed` condition, (reason, message).
        spec_file = os.path.join(base, "spec.json")
        with open(spec_file, "w") as f:
            f.write(self.manifests["ConfigMap"]["data"]["spec.json"])
        mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "runs")
        volume = os.path.join(base, "claim") if mount == "/runs" else mount  # One claim, shared.
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        self.pods = [Pod(i, f"{self.name}-{i}.{self.name}", self._substitute(
            container["command"], {"JOB_COMPLETION_INDEX": str(i)}, volume, spec_file, mount),
            {**env, "JOB_COMPLETION_INDEX": str(i)}, volume) for i in range(self.job["completions"])]

    def on_exit(self, pod, code):
        for index, rule in enumerate(self.job["podFailurePolicy"]["rules"]):
            on_exit = rule.get("onExitCodes")
            if on_exit and (code in on_exit["values"]) == (on_exit["operator"] == "In"):
                action = {"Ignore": "recreate_pod", "FailJob": "fail"}[rule["action"]]
                if action == "fail":  # Kubernetes's words (pkg/controller/job/pod_failure_policy.go).
                    self.failure = ("PodFailurePolicy", f"Container {self.container['name']} for pod default/"
                                    f"{self.name}-{pod.index} failed with exit code {code} matching FailJob rule "
                                    f"at index {index}")
                break
        else:
            self.failures += 1
            action = "fail" if self.failures > self.job["backoffLimit"] else "recreate_pod"
            if action == "fail":
                self.failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
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
