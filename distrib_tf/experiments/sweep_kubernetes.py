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
`kubectl apply -f TRIAL_DIR/job.yaml` submits, `kubectl get job NAME -o json` follows (its
`Complete` or `Failed` condition; a `FailJob` rule's message carries the exit code),
`kubectl delete --cascade=foreground` cancels (each pod gets SIGTERM, backs up one step and
stops within its grace period; the Job is gone once its pods are). The Job's rules: a
preempted pod (75) or an evicted one is recreated without counting, a crash counts against
`backoffLimit`, and 2 (bad input), 3 (pruned) and 65 (a NaN stop) fail it at once, so a pruned
trial is not retried. Ended Jobs stay for `kubectl logs`; `kubectl delete
job,service,configmap -l distrib-tf/study=NAME` removes a sweep's.

This module imports no TensorFlow.
"""

import dataclasses
import json
import os
import re
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


def job_name(study_name: str, trial_id: str, number: int) -> str:
    """The trial's Job, Service and ConfigMap name: a DNS label short enough for its pods'
    hostnames (`NAME-INDEX`). Pure.

    Example:

        >>> job_name("My sweep", "0a1b2c3d4e", 7)
        'my-sweep-0a1b2c3d4e-7'
    """
    return f"{study_label(study_name)}-{trial_id}-{number}"


def _under(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(directory)]) == os.path.abspath(directory)


@dataclasses.dataclass(frozen=True)
class KubernetesEngine:
    """Each trial an Indexed Job of `workers` pods of `image`, the claim `volume_claim` mounted
    at `mount` in each (see the module docstring).

    Example:

        engine = KubernetesEngine(workers=2, image="registry.example/job:1", volume_claim="runs",
                                  mount="/runs")
        job = engine.submit(trial, sweep)   # "kubernetes:distrib-tf-0a1b2c3d4e-7"
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
        name = job_name(sweep.study_name, trial.id, trial.number)
        return kubernetes.kubernetes_manifests(
            ClusterSpec.local_workers(self.workers), name=name, image=self.image, command=command,
            max_restarts=self.max_restarts, volume_claim=self.volume_claim, mount_path=self.mount,
            env={trial_lib.ENV: sweep_engines.trial_environment(trial, sweep)[trial_lib.ENV]},
            launcher_options=(f"--events={os.path.join(trial.model_dir, 'events.jsonl')}",
                              f"--log_dir={trial.model_dir}"),
            labels={STUDY_LABEL: study_label(sweep.study_name), "distrib-tf/trial": str(trial.number)})

    def submit(self, trial, sweep) -> str:
        """Writes `job.yaml` into the trial's directory and applies it: `kubernetes:NAME`."""
        documents = self.manifests(trial, sweep)
        path = os.path.join(trial.model_dir, "job.yaml")
        try:
            os.makedirs(trial.model_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                yaml.safe_dump_all(documents, f, sort_keys=False)
        except OSError as e:
            raise sweep_engines.EngineError(f"cannot write {path}: {e.strerror}") from e
        result = sweep_engines.run_command(["kubectl", "apply", "-f", path])
        if result.returncode != 0:
            raise sweep_engines.EngineError(f"kubectl apply refused trial {trial.number}: "
                                            f"{sweep_engines.said(result)}")
        return f"kubernetes:{documents[-1]['metadata']['name']}"

    def poll(self, job: str, model_dir: str) -> int | None:  # pylint: disable=unused-argument
        """`None` while the Job runs (or is being deleted); then its exit code: 0 when complete,
        the code a `FailJob` rule matched, else 1 (`backoffLimit` spent); `GONE` once deleted."""
        result = sweep_engines.run_command(["kubectl", "get", "job", job.removeprefix("kubernetes:"), "-o", "json"])
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return sweep_engines.GONE
            return None  # The API server busy: ask again.
        try:
            status = json.loads(result.stdout).get("status", {})
        except json.JSONDecodeError:
            return None
        ended = {c["type"]: c for c in status.get("conditions", []) if c.get("status") == "True"}
        if "Complete" in ended:
            code = exit_codes.OK
        elif "Failed" in ended:
            found = re.search(r"failed with exit code (\d+)", ended["Failed"].get("message", ""))
            code = int(found.group(1)) if found else exit_codes.FAILED
        else:
            return None
        self._collect_logs(job.removeprefix("kubernetes:"), model_dir)
        return code

    def _collect_logs(self, name: str, model_dir: str) -> None:
        """Appends the Job's pods' output (each line prefixed with its pod) to the trial's
        `trial.log`: the launchers' own lines, beside the tasks' `TYPE_INDEX.log`."""
        result = sweep_engines.run_command(
            ["kubectl", "logs", "-l", f"batch.kubernetes.io/job-name={name}", "--prefix", "--tail=-1",
             f"--max-log-requests={max(5, self.workers)}"])
        with open(os.path.join(model_dir, "trial.log"), "a", encoding="utf-8") as f:
            f.write(result.stdout if result.returncode == 0 else f"kubectl logs: {sweep_engines.said(result)}\n")

    def cancel(self, job: str) -> None:
        """Deletes the trial's Job (its pods first: SIGTERM, a backup, exit), Service and ConfigMap."""
        name = job.removeprefix("kubernetes:")
        result = sweep_engines.run_command(["kubectl", "delete", f"job/{name}", f"service/{name}",
                                            f"configmap/{name}", "--cascade=foreground", "--wait=false",
                                            "--ignore-not-found"])
        if result.returncode != 0:
            raise sweep_engines.EngineError(f"kubectl delete {name}: {sweep_engines.said(result)}")
