"""Kubernetes manifests for the same job: `distrib-tf-export kubernetes`.

`kubernetes_manifests` writes a ConfigMap holding the spec, a headless Service and an Indexed Job
with one pod per task of the spec. Pod `i` runs `distrib-tf-launch --task_ordinal=i`:
the launcher gives it the `TF_CONFIG` of the spec's i-th task, with each task's address
replaced by its pod's stable DNS name (`NAME-i.NAME:PORT`). Failed pods are retried
(`backoffLimit` = `--max_restarts`); a pod that exits 75 (preempted, its state saved) is
recreated without counting against that limit, and one that exits 2 (bad input) or 65
(a NaN or Inf loss) fails the Job at once (`podFailurePolicy`). `/runs` in every pod is the volume claim
`--volume_claim` (put `--model_dir` under it: backups must outlive the pod), else an
`emptyDir` that dies with the pod, with a warning.

`jobset_manifests` writes the same job as a JobSet (kubernetes-sigs/jobset, API
`jobset.x-k8s.io/v1alpha2`, checked against the 0.12.0 CRD): one Indexed Job of N pods
with `backoffLimit: 0`, so that any failed pod fails the Job and JobSet's failure policy
recreates every pod at once (a multi-worker TensorFlow job cannot continue without one of
them). Its rules, first match wins: exit 2 or 65 fail the JobSet (a retry would fail
again); exit 75 and a disruption (eviction, preemption) restart it without counting
against `maxRestarts`; anything else (a crash, a dead peer) restarts it and counts.
Pods find each other at JobSet's DNS names, `NAME-task-0-i.NAME`. Storage is the same
`--volume_claim` on every pod (ReadWriteMany: the backups of each task go to their own
directory under `model_dir/backup/`).

This module imports no TensorFlow.
"""

import json

from distrib_tf import exit_codes
from distrib_tf.cluster import ClusterSpec
from distrib_tf.deploy import launcher_grace

RUNS = "/runs"


def _addressed(spec: ClusterSpec, address, source: str) -> ClusterSpec:
    """`spec` with its i-th task (in the spec's order) at `address(i)`."""
    jobs, ordinal = {}, 0
    for job, addresses in spec.jobs.items():
        jobs[job] = tuple(address(ordinal + i) for i in range(len(addresses)))
        ordinal += len(addresses)
    return ClusterSpec(jobs, source=source)


def kubernetes_spec(spec: ClusterSpec, *, name: str, port: int) -> ClusterSpec:
    """The spec as seen inside the cluster: task i lives at `NAME-i.NAME:PORT`."""
    return _addressed(spec, lambda i: f"{name}-{i}.{name}:{port}", f"the Kubernetes spec of {spec.source}")


def _container(*, image: str, command: list[str], port: int, gpus_per_task: int,
               grace_seconds: int) -> dict:
    """The task's container: the launcher, given its task by the Job's completion index."""
    container = {
        "name": "task",
        "image": image,
        "command": ["distrib-tf-launch", "--cluster_spec=/etc/distrib_tf/spec.json",
                    "--task_ordinal=$(JOB_COMPLETION_INDEX)",
                    f"--grace_period={launcher_grace(grace_seconds)}", "--", *command],
        "ports": [{"containerPort": port, "name": "grpc"}],
        "volumeMounts": [{"name": "spec", "mountPath": "/etc/distrib_tf"},
                         {"name": "runs", "mountPath": RUNS}],
    }
    if gpus_per_task:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_task}}
    return container


def _volumes(name: str, volume_claim: str | None) -> list[dict]:
    runs = ({"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}} if volume_claim
            else {"name": "runs", "emptyDir": {}})
    return [{"name": "spec", "configMap": {"name": name}}, runs]


def _config_map(spec: ClusterSpec, name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
            "data": {"spec.json": json.dumps(spec.to_dict(), indent=2)}}


def kubernetes_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                         port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                         volume_claim: str | None = None, grace_seconds: int = 120) -> list[dict]:
    """ConfigMap, headless Service and Indexed Job for `spec`. Pure."""
    pod_spec = kubernetes_spec(spec, name=name, port=port)
    labels = {"app.kubernetes.io/name": name}
    container = _container(image=image, command=command, port=port, gpus_per_task=gpus_per_task,
                           grace_seconds=grace_seconds)
    tasks = len(spec.tasks)
    return [
        _config_map(pod_spec, name, labels),
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
         "spec": {"clusterIP": "None", "selector": labels, "ports": [{"port": port, "name": "grpc"}]}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
         "spec": {
             "completionMode": "Indexed", "completions": tasks, "parallelism": tasks,
             "backoffLimit": max_restarts,
             "podFailurePolicy": {"rules": [
                 {"action": "Ignore", "onExitCodes": {"containerName": "task", "operator": "In",
                                                      "values": [exit_codes.PREEMPTED]}},
                 {"action": "FailJob", "onExitCodes": {"containerName": "task", "operator": "In",
                                                       "values": [exit_codes.USAGE, exit_codes.NONFINITE]}},
                 {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
             ]},
             "template": {
                 "metadata": {"labels": labels},
                 "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container],
                          "terminationGracePeriodSeconds": grace_seconds,
                          "volumes": _volumes(name, volume_claim)},
             },
         }},
    ]


REPLICATED_JOB = "task"


def jobset_spec(spec: ClusterSpec, *, name: str, port: int) -> ClusterSpec:
    """The spec as seen inside the JobSet: task i lives at `NAME-task-0-i.NAME:PORT`."""
    return _addressed(spec, lambda i: f"{name}-{REPLICATED_JOB}-0-{i}.{name}:{port}",
                      f"the JobSet spec of {spec.source}")


def jobset_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                     port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                     volume_claim: str | None = None, grace_seconds: int = 120) -> list[dict]:
    """ConfigMap and JobSet for `spec` (see the module docstring for its failure policy). Pure."""
    labels = {"app.kubernetes.io/name": name}
    container = _container(image=image, command=command, port=port, gpus_per_task=gpus_per_task,
                           grace_seconds=grace_seconds)
    tasks = len(spec.tasks)

    def on_exit(codes):
        return {"containerName": "task", "operator": "In", "values": codes}

    return [
        _config_map(jobset_spec(spec, name=name, port=port), name, labels),
        {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name, "labels": labels},
         "spec": {
             "network": {"enableDNSHostnames": True, "subdomain": name},
             "failurePolicy": {"maxRestarts": max_restarts, "rules": [
                 # Kubernetes's message for a FailJob rule: "Container task for pod NS/POD failed
                 # with exit code N matching FailJob rule at index I"; for a pod condition:
                 # "Pod NS/POD has condition DisruptionTarget matching FailJob rule at index I".
                 {"name": "BadInputOrNonFinite", "action": "FailJobSet",
                  "onJobFailureReasons": ["PodFailurePolicy"],
                  "onJobFailureMessagePatterns": [
                      f"failed with exit code ({exit_codes.USAGE}|{exit_codes.NONFINITE}) matching"]},
                 {"name": "PreemptedOrDisrupted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                  "onJobFailureReasons": ["PodFailurePolicy"],
                  "onJobFailureMessagePatterns": [f"failed with exit code {exit_codes.PREEMPTED} matching",
                                                  "has condition DisruptionTarget matching"]},
             ]},
             "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": {
                 "completionMode": "Indexed", "completions": tasks, "parallelism": tasks,
                 "backoffLimit": 0,  # One failed pod fails the Job: the JobSet then acts on all.
                 "podFailurePolicy": {"rules": [
                     {"action": "FailJob", "onExitCodes": on_exit([exit_codes.USAGE, exit_codes.NONFINITE])},
                     {"action": "FailJob", "onExitCodes": on_exit([exit_codes.PREEMPTED])},
                     {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                 ]},
                 "template": {
                     "metadata": {"labels": labels},
                     "spec": {"restartPolicy": "Never", "containers": [container],
                              "terminationGracePeriodSeconds": grace_seconds,
                              "volumes": _volumes(name, volume_claim)},
                 },
             }}}],
         }},
    ]
