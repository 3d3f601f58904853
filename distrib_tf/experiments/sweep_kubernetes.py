"""`distrib-tf-sweep --engine=kubernetes`: each trial an Indexed Job, through `kubectl`.

Each trial is what `distrib-tf-export kubernetes` writes (`distrib_tf.deploy.kubernetes`: a
ConfigMap holding the spec, a headless Service and an Indexed Job of `workers` pods, each
the launcher for its task) with the trial's values in the container's environment and
its directory on the claim. The claim `--volume_claim` (ReadWriteMany) is mounted at
`--claim_mount` in every pod of every trial, the same path the sweep sees it at (the sweep
runs in a pod of its own that mounts the claim there, or on a host that has it mounted
there), without a sub-path: each trial's backups, `events.jsonl` and its tasks' logs
(`TYPE_INDEX.log`) are in its directory under `--sweep_dir`, which must lie on the claim;
once its Job ends, its pods' output (`kubectl logs`) is appended to its `trial.log`.

The sweep talks to the cluster only through `kubectl` (its current context and namespace):
`kubectl create -f TRIAL_DIR/job.yaml` submits (each trial's objects under a name of its own,
random-suffixed, so no other sweep's Job is ever taken for it), `kubectl get job.batch NAME`
follows (its `Complete` or `Failed` condition once no pod is active or stopping; a `FailJob`
rule's message carries the exit code), `kubectl delete --cascade=foreground` cancels (each
pod gets SIGTERM, backs up one step and stops within its grace period; the Job is gone once
its pods are, then its Service and ConfigMap). The Job's rules: a preempted pod (75) or an
evicted one is recreated without counting, a crash counts against `backoffLimit`, and 2 (bad
input), 3 (pruned) and 65 (a NaN stop) fail it at once, so a pruned trial is not retried.
Ended Jobs stay for `kubectl logs`; `kubectl delete job,service,configmap -l
distrib-tf/study=LABEL` removes a sweep's. The sweep's account needs, in its namespace:
create, get and delete on jobs, services and configmaps; get on persistentvolumeclaims;
list on pods and get on pods/log. The trial's environment, the study's URL in it, is in
the Job's spec: a PostgreSQL password there is readable by whoever may read Jobs (a journal
file on the claim, or a role without a password, keeps it out).

This module imports no TensorFlow.
"""

import dataclasses
import json
import os
import re
import secrets
import shutil
import sys

import yaml

from distrib_tf import exit_codes
from distrib_tf import trial as trial_lib
from distrib_tf.cluster import ClusterSpec
from distrib_tf.deploy import kubernetes
from distrib_tf.experiments import sweep_engines

STUDY_LABEL = "distrib-tf/study"


def study_label(study_name: str) -> str:
    """The study's name as a DNS label's start (lowercase letters, digits and `-`, a letter
    first, at most 30 characters): the trials' Jobs' label `distrib-tf/study`. Pure.

    Example:

        >>> study_label("My sweep"), study_label("2025_lr")
        ('my-sweep', 'sweep-2025-lr')
    """
    study = re.sub(r"[^a-z0-9]+", "-", study_name.lower()).strip("-")
    return (study if study[:1].isalpha() else f"sweep-{study}".rstrip("-"))[:30].rstrip("-")


def job_name(study_name: str, trial_id: str, number: int, suffix: str) -> str:
    """The trial's Job, Service and ConfigMap name: a DNS label short enough for its pods'
    hostnames (`NAME-INDEX`), `suffix` making it one no other sweep's Job has (the sweep
    records the name: it need not be found again). Pure.

    Example:

        >>> job_name("My sweep", "0a1b2c3d4e", 7, "x7k2p")
        'my-sweep-0a1b2c3d4e-7-x7k2p'
    """
    return f"{study_label(study_name)}-{trial_id}-{number}-{suffix}"


def _suffix() -> str:
    """Five random DNS-label characters, as Kubernetes's `generateName` adds."""
    return "".join(secrets.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))


def _under(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(directory)]) == os.path.abspath(directory)


@dataclasses.dataclass(frozen=True)
class KubernetesEngine:
    """Each trial an Indexed Job of `workers` pods of `image`, the claim `volume_claim` mounted
    at `mount` in each (see the module docstring).

    Example:

        engine = KubernetesEngine(workers=2, image="registry.example/job:1", volume_claim="runs",
                                  mount="/runs")
        job = engine.submit(trial, sweep)   # "kubernetes:distrib-tf-0a1b2c3d4e-7-x7k2p"
        engine.poll(job, trial.model_dir)   # None while its pods run, then its exit code
    """

    workers: int
    image: str
    volume_claim: str
    mount: str
    max_restarts: int = 3
    name = "kubernetes"

    def check(self) -> None:
        """Raises a one-line `ValueError` when kubectl is missing or a flag is."""
        if shutil.which("kubectl") is None:
            raise ValueError("Invalid value for `--engine`. Received: kubernetes, but no kubectl on PATH. Expected "
                             "kubectl, with a context that may create Jobs, or --engine=local.")
        for value, flag in ((self.image, "--image"), (self.volume_claim, "--volume_claim")):
            if not value:
                raise ValueError(f"Missing `{flag}` for --engine=kubernetes. Expected "
                                 + ("the container image that holds distrib_tf and the script."
                                    if flag == "--image" else "a ReadWriteMany PersistentVolumeClaim, mounted at "
                                    "--claim_mount in the trials' pods and in the sweep's own."))
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", self.volume_claim):
            raise ValueError(f"Invalid value for `--volume_claim`. Received: {self.volume_claim}. Expected a "
                             "PersistentVolumeClaim's name: lowercase letters, digits, '-' and '.'.")
        found = sweep_engines.run_command(["kubectl", "get", f"persistentvolumeclaim/{self.volume_claim}",
                                           "-o", "name"])
        if found.returncode != 0:
            raise ValueError(f"Invalid value for `--volume_claim`. Received: {self.volume_claim} (kubectl: "
                             f"{sweep_engines.said(found)}). Expected a ReadWriteMany claim in kubectl's current "
                             "namespace that this account may read.")
        if not os.path.isabs(self.mount):
            raise ValueError(f"Invalid value for `--claim_mount`. Received: {self.mount}. Expected an absolute "
                             "path: where the claim is mounted here and in every trial's pod.")

    def check_paths(self, *, sweep_dir: str, storage: str) -> None:
        """Raises a one-line `ValueError` for a sweep directory, or a journal file, off the claim."""
        for path, flag in ((sweep_dir, "--sweep_dir"),
                           *(((storage[len("journal:"):], "--storage"),) if storage.startswith("journal:") else ())):
            if not _under(path, self.mount):
                raise ValueError(f"Invalid value for `{flag}` with --engine=kubernetes. Received: "
                                 f"{os.path.abspath(path)}. Expected a path under --claim_mount={self.mount}, on the "
                                 "claim the trials' pods mount (they write there and the sweep reads it).")

    def manifests(self, trial, sweep) -> list[dict]:
        """The trial's ConfigMap, Service and Job: `distrib-tf-export kubernetes`'s, with the
        trial's values in the environment, its directory on the claim at the same path."""
        command = list(sweep.command)
        if command[0] == sys.executable:  # The image's interpreter, not this host's path to it.
            command[0] = "python"
        name = job_name(sweep.study_name, trial.id, trial.number, _suffix())
        return kubernetes.kubernetes_manifests(
            ClusterSpec.local_workers(self.workers), name=name, image=self.image, command=command,
            max_restarts=self.max_restarts, volume_claim=self.volume_claim, mount_path=self.mount,
            env={trial_lib.ENV: sweep_engines.trial_environment(trial, sweep)[trial_lib.ENV]},
            launcher_options=(f"--events={os.path.join(trial.model_dir, 'events.jsonl')}",
                              f"--log_dir={trial.model_dir}"),
            labels={STUDY_LABEL: study_label(sweep.study_name), "distrib-tf/trial": str(trial.number)})

    def submit(self, trial, sweep) -> str:
        """Writes `job.yaml` into the trial's directory and creates its objects: `kubernetes:NAME`."""
        documents = self.manifests(trial, sweep)
        path = os.path.join(trial.model_dir, "job.yaml")
        try:
            os.makedirs(trial.model_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                yaml.safe_dump_all(documents, f, sort_keys=False)
        except OSError as e:
            raise sweep_engines.EngineError(f"cannot write {path}: {e.strerror}") from e
        result = sweep_engines.run_command(["kubectl", "create", "-f", path])
        if result.returncode != 0:
            raise sweep_engines.EngineError(f"kubectl create refused trial {trial.number}: "
                                            f"{sweep_engines.said(result)}")
        return f"kubernetes:{documents[-1]['metadata']['name']}"

    def poll(self, job: str, model_dir: str) -> int | None:
        """`None` while the Job runs (or is being deleted, or its pods are still stopping);
        then its exit code: 0 when complete, the code a `FailJob` rule matched, else 1
        (`backoffLimit` spent); `GONE` once deleted (its Service and ConfigMap then go too).

        Raises:
            EngineError: kubectl failed (no access, no cluster): the sweep says it and asks again.
        """
        name = job.removeprefix("kubernetes:")
        result = sweep_engines.run_command(["kubectl", "get", "job.batch", name, "--ignore-not-found", "-o", "json"])
        if result.returncode != 0:
            raise sweep_engines.EngineError(f"kubectl get job.batch {name}: {sweep_engines.said(result)}")
        if not result.stdout.strip():
            sweep_engines.run_command(["kubectl", "delete", f"service/{name}", f"configmap/{name}",
                                       "--ignore-not-found", "--wait=false"])
            return sweep_engines.GONE
        try:
            status = json.loads(result.stdout).get("status", {})
        except json.JSONDecodeError:
            return None
        if status.get("active") or status.get("terminating"):  # Before 1.31 `Failed` comes first.
            return None
        ended = {c["type"]: c for c in status.get("conditions", []) if c.get("status") == "True"}
        if "Complete" in ended:
            code = exit_codes.OK
        elif "Failed" in ended:
            found = re.search(r"failed with exit code (\d+)", ended["Failed"].get("message", ""))
            code = int(found.group(1)) if found else exit_codes.FAILED
        else:
            return None
        self._collect_logs(name, model_dir)
        return code

    def _collect_logs(self, name: str, model_dir: str) -> None:
        """Appends the Job's pods' output (each line prefixed with its pod) to the trial's
        `trial.log`: the launchers' own lines, beside the tasks' `TYPE_INDEX.log`."""
        try:
            result = sweep_engines.run_command(
                ["kubectl", "logs", "-l", f"batch.kubernetes.io/job-name={name}", "--prefix", "--tail=-1",
                 "--ignore-errors", f"--max-log-requests={max(5, self.workers)}"])
            text = result.stdout + ("" if result.returncode == 0 else f"kubectl logs: {sweep_engines.said(result)}\n")
        except sweep_engines.EngineError as e:
            text = f"kubectl logs: {e}\n"
        with open(os.path.join(model_dir, "trial.log"), "a", encoding="utf-8") as f:
            f.write(text)

    def cancel(self, job: str) -> None:
        """Deletes the trial's Job, its pods first (SIGTERM, a backup, exit); its Service and
        ConfigMap, which the pods need until then, go once `poll` finds the Job gone."""
        name = job.removeprefix("kubernetes:")
        result = sweep_engines.run_command(["kubectl", "delete", f"job.batch/{name}", "--cascade=foreground",
                                            "--wait=false", "--ignore-not-found"])
        if result.returncode != 0:
            raise sweep_engines.EngineError(f"kubectl delete job.batch/{name}: {sweep_engines.said(result)}")
