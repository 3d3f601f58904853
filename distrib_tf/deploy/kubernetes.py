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

This module imports no TensorFlow.
"""

import json

from distrib_tf import exit_codes
from distrib_tf.cluster import ClusterSpec
from distrib_tf.deploy import launcher_grace

RUNS = "/runs"


def kubernetes_spec(spec: ClusterSpec, *, name: str, port: int) -> ClusterSpec:
    """The spec as seen inside the cluster: task i lives at `NAME-i.NAME:PORT`."""
    jobs, ordinal = {}, 0
    for job, addresses in spec.jobs.items():
        jobs[job] = tuple(f"{name}-{ordinal + i}.{name}:{port}" for i in range(len(addresses)))
        ordinal += len(addresses)
    return ClusterSpec(jobs, source=f"the Kubernetes spec of {spec.source}")


def kubernetes_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                         port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                         volume_claim: str | None = None, grace_seconds: int = 120) -> list[dict]:
    """ConfigMap, headless Service and Indexed Job for `spec`. Pure."""
    pod_spec = kubernetes_spec(spec, name=name, port=port)
    labels = {"app.kubernetes.io/name": name}
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
    runs = ({"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}} if volume_claim
            else {"name": "runs", "emptyDir": {}})
    if gpus_per_task:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_task}}
    tasks = len(spec.tasks)
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
         "data": {"spec.json": json.dumps(pod_spec.to_dict(), indent=2)}},
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
                          "volumes": [{"name": "spec", "configMap": {"name": name}}, runs]},
             },
         }},
    ]
