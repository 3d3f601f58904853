"""Kubernetes manifests for the same job: `distrib-tf-export kubernetes`.

`kubernetes_manifests` writes a ConfigMap holding the spec, a headless Service and an Indexed Job
with one pod per task of the spec. Pod `i` runs `distrib-tf-launch --task_ordinal=i`:
the launcher gives it the `TF_CONFIG` of the spec's i-th task, with each task's address
replaced by its pod's stable DNS name (`NAME-i.NAME:PORT`). Failed pods are retried
(`backoffLimit` = `--max_restarts` times the tasks: a dead task fails its peers too, so one
restart of the job costs a pod per task); a pod that exits 75 (preempted, its state saved) is
recreated without counting against that limit, and one that exits 2 (bad input), 3 (pruned by a
sweep) or 65 (a NaN or Inf loss) fails the Job at once (`podFailurePolicy`). `/runs` in every pod is the volume claim
`--volume_claim` (put `--model_dir` under it: backups must outlive the pod), else an
`emptyDir` that dies with the pod, with a warning.

`jobset_manifests` writes the same job as a JobSet (kubernetes-sigs/jobset, API
`jobset.x-k8s.io/v1alpha2`, checked against the 0.12.0 CRD): one Indexed Job of N pods
with `backoffLimit: 0`, so that any failed pod fails the Job and JobSet's failure policy
recreates every pod at once (a multi-worker TensorFlow job cannot continue without one of
them). Its rules, first match wins: exit 2, 3 or 65 fail the JobSet (a retry would fail
again, or was not asked for); exit 75 and a disruption (eviction, preemption) restart it without counting
against `maxRestarts`; anything else (a crash, a dead peer) restarts it and counts.
Pods find each other at JobSet's DNS names, `NAME-task-0-i.NAME`. Storage is one
ReadWriteMany `--volume_claim` with a sub-path per task (`task-$(JOB_COMPLETION_INDEX)`):
each task has its own `/runs`, as on a disk of its own.

`trainjob_manifests` writes the JobSet above as a Kubeflow Trainer v2 `TrainingRuntime`
and a `TrainJob` that uses it; `tfjob_manifests` a Training Operator `TFJob` whose pods
take `TF_CONFIG` from the operator and exit with codes its `ExitCode` policy reads
(`distrib_tf.exit_codes.for_tfjob`).

This module imports no TensorFlow.
"""

import json

from distrib_tf import exit_codes
from distrib_tf.cluster import ClusterSpec
from distrib_tf.deploy import launcher_grace

RUNS = "/runs"
# Exit codes a retry cannot cure (bad input; a NaN stop) or that a sweep did not ask to retry (pruned).
NOT_RETRIED = (exit_codes.USAGE, exit_codes.PRUNED, exit_codes.NONFINITE)


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
               grace_seconds: int, name: str = "task", per_task_volume: bool = False,
               mount_path: str = RUNS, env: dict | None = None, launcher_options: tuple = ()) -> dict:
    """The task's container: the launcher, given its task by the Job's completion index."""
    runs = {"name": "runs", "mountPath": mount_path}
    if per_task_volume:  # One claim for all: each task in its own directory, as on its own disk.
        runs["subPathExpr"] = "task-$(JOB_COMPLETION_INDEX)"
    container = {
        "name": name,
        "image": image,
        "command": ["distrib-tf-launch", "--cluster_spec=/etc/distrib_tf/spec.json",
                    "--task_ordinal=$(JOB_COMPLETION_INDEX)",
                    f"--grace_period={launcher_grace(grace_seconds)}", *launcher_options, "--", *command],
        "ports": [{"containerPort": port, "name": "grpc"}],
        "volumeMounts": [{"name": "spec", "mountPath": "/etc/distrib_tf"}, runs],
    }
    if env:
        container["env"] = [{"name": key, "value": value} for key, value in env.items()]
    if gpus_per_task:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_task}}
    return container


def _volumes(name: str, volume_claim: str | None) -> list[dict]:
    runs = ({"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}} if volume_claim
            else {"name": "runs", "emptyDir": {}})
    return [{"name": "spec", "configMap": {"name": name}}, runs]


def _check_evaluator(spec: ClusterSpec, engine: str, volume_claim: str | None) -> None:
    """Refuses an evaluator where every task mounts its own sub-path of the claim: its
    `checkpoints/` would stay empty (the chief's are in the chief's sub-path)."""
    if volume_claim and spec.jobs.get("evaluator"):
        raise ValueError(
            f"Invalid value for `--cluster_spec` with --engine={engine}. Received: an evaluator task. Expected "
            "none: each task mounts its own sub-path of --volume_claim, so an evaluator would never see the "
            "chief's checkpoints. Use --engine=job (one shared mount), or evaluate model_dir/checkpoints/ "
            "after training.")


def _config_map(spec: ClusterSpec, name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
            "data": {"spec.json": json.dumps(spec.to_dict(), indent=2)}}


def kubernetes_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                         port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                         volume_claim: str | None = None, grace_seconds: int = 120, mount_path: str = RUNS,
                         env: dict | None = None, launcher_options: tuple = (),
                         labels: dict | None = None) -> list[dict]:
    """ConfigMap, headless Service and Indexed Job for `spec`. Pure.

    A sweep's trial (`distrib_tf.experiments.sweep_kubernetes.KubernetesEngine`) adds the claim's
    `mount_path` (as in the sweep's own pod), the container's `env`, the launcher's
    `launcher_options` and `labels` of its own."""
    pod_spec = kubernetes_spec(spec, name=name, port=port)
    labels = {"app.kubernetes.io/name": name, **(labels or {})}
    container = _container(image=image, command=command, port=port, gpus_per_task=gpus_per_task,
                           grace_seconds=grace_seconds, mount_path=mount_path, env=env,
                           launcher_options=launcher_options)
    tasks = len(spec.tasks)
    return [
        _config_map(pod_spec, name, labels),
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
         "spec": {"clusterIP": "None", "selector": labels, "ports": [{"port": port, "name": "grpc"}]}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
         "spec": {
             "completionMode": "Indexed", "completions": tasks, "parallelism": tasks,
             # A dead task fails its peers too: one restart of the job costs a pod per task.
             "backoffLimit": max_restarts * tasks,
             "podFailurePolicy": {"rules": [
                 {"action": "Ignore", "onExitCodes": {"containerName": "task", "operator": "In",
                                                      "values": [exit_codes.PREEMPTED]}},
                 {"action": "FailJob", "onExitCodes": {"containerName": "task", "operator": "In",
                                                       "values": list(NOT_RETRIED)}},
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


def jobset_spec(spec: ClusterSpec, *, name: str, port: int, job: str = REPLICATED_JOB) -> ClusterSpec:
    """The spec as seen inside the JobSet NAME: task i lives at `NAME-JOB-0-i.NAME:PORT`,
    the DNS name JobSet gives pod i of the first Job of its replicated job JOB."""
    return _addressed(spec, lambda i: f"{name}-{job}-0-{i}.{name}:{port}",
                      f"the JobSet spec of {spec.source}")


def jobset_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                     port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                     volume_claim: str | None = None, grace_seconds: int = 120) -> list[dict]:
    """ConfigMap and JobSet for `spec` (see the module docstring for its failure policy). Pure."""
    _check_evaluator(spec, "jobset", volume_claim)
    labels = {"app.kubernetes.io/name": name}
    container = _container(image=image, command=command, port=port, gpus_per_task=gpus_per_task,
                           grace_seconds=grace_seconds, per_task_volume=bool(volume_claim))
    return [
        _config_map(jobset_spec(spec, name=name, port=port), name, labels),
        {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name, "labels": labels},
         "spec": _jobset_body(spec, name=name, job_name=REPLICATED_JOB, container=container,
                              labels=labels, max_restarts=max_restarts, volume_claim=volume_claim,
                              grace_seconds=grace_seconds)},
    ]


def _jobset_body(spec: ClusterSpec, *, name: str, job_name: str, container: dict, labels: dict,
                 max_restarts: int, volume_claim: str | None, grace_seconds: int,
                 job_labels: dict | None = None) -> dict:
    """A JobSet's spec: one Indexed Job of every task, restarted together (module docstring)."""
    tasks = len(spec.tasks)

    def on_exit(codes):
        return {"containerName": container["name"], "operator": "In", "values": codes}

    job = {"spec": {
        "completionMode": "Indexed", "completions": tasks, "parallelism": tasks,
        "backoffLimit": 0,  # One failed pod fails the Job: the JobSet then acts on all.
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": on_exit(list(NOT_RETRIED))},
            {"action": "FailJob", "onExitCodes": on_exit([exit_codes.PREEMPTED])},
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {
            "metadata": {"labels": labels},
            "spec": {"restartPolicy": "Never", "containers": [container],
                     "terminationGracePeriodSeconds": grace_seconds,
                     "volumes": _volumes(name, volume_claim)},
        },
    }}
    if job_labels:
        job["metadata"] = {"labels": job_labels}
    return {
        "network": {"enableDNSHostnames": True, "subdomain": name},
        "failurePolicy": {"maxRestarts": max_restarts, "rules": [
            # Kubernetes's message for a FailJob rule: "Container task for pod NS/POD failed
            # with exit code N matching FailJob rule at index I"; for a pod condition:
            # "Pod NS/POD has condition DisruptionTarget matching FailJob rule at index I".
            {"name": "NotRetried", "action": "FailJobSet",
             "onJobFailureReasons": ["PodFailurePolicy"],
             "onJobFailureMessagePatterns": [
                 f"failed with exit code ({'|'.join(map(str, NOT_RETRIED))}) matching"]},
            {"name": "PreemptedOrDisrupted", "action": "RestartJobSetAndIgnoreMaxRestarts",
             "onJobFailureReasons": ["PodFailurePolicy"],
             "onJobFailureMessagePatterns": [f"failed with exit code {exit_codes.PREEMPTED} matching",
                                             "has condition DisruptionTarget matching"]},
        ]},
        "replicatedJobs": [{"name": job_name, "replicas": 1, "template": job}],
    }


TRAINER_JOB = "node"  # Kubeflow Trainer's name for the trainer's Job and its container.
TRAINER_API = "trainer.kubeflow.org/v1alpha1"


def trainjob_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                       port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                       volume_claim: str | None = None, grace_seconds: int = 120) -> list[dict]:
    """ConfigMap, TrainingRuntime and TrainJob (Kubeflow Trainer v2) for `spec`. Pure.

    Trainer ships no TensorFlow runtime; this one is plain (`mlPolicy` without a framework,
    Trainer's PlainML plugin): a JobSet whose trainer Job runs our launcher in every pod,
    with the JobSet failure policy of `jobset_manifests`. The TrainJob's JobSet is named
    after it, so the pods' hostnames, and the spec in the ConfigMap, follow from NAME.
    """
    _check_evaluator(spec, "trainjob", volume_claim)
    labels = {"app.kubernetes.io/name": name}
    container = _container(image=image, command=command, port=port, gpus_per_task=gpus_per_task,
                           grace_seconds=grace_seconds, name=TRAINER_JOB,
                           per_task_volume=bool(volume_claim))
    tasks = len(spec.tasks)
    body = _jobset_body(spec, name=name, job_name=TRAINER_JOB, container=container, labels=labels,
                        max_restarts=max_restarts, volume_claim=volume_claim,
                        grace_seconds=grace_seconds,
                        job_labels={"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"})
    return [
        _config_map(jobset_spec(spec, name=name, port=port, job=TRAINER_JOB), name, labels),
        {"apiVersion": TRAINER_API, "kind": "TrainingRuntime", "metadata": {"name": name, "labels": labels},
         "spec": {"mlPolicy": {"numNodes": tasks}, "template": {"spec": body}}},
        {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": {"name": name, "labels": labels},
         "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": name},
                  "trainer": {"numNodes": tasks}}},
    ]


TFJOB_CONTAINER = "tensorflow"  # The Training Operator reads the exit code of this container.
_TFJOB_TYPES = {"chief": "Chief", "worker": "Worker", "evaluator": "Evaluator"}


def tfjob_manifests(spec: ClusterSpec, *, name: str, image: str, command: list[str],
                    port: int = 2222, gpus_per_task: int = 0, max_restarts: int = 3,
                    volume_claim: str | None = None, grace_seconds: int = 120) -> list[dict]:
    """A TFJob (Kubeflow Training Operator 1.9, `kubeflow.org/v1`) for `spec`. Pure.

    The operator gives every pod its `TF_CONFIG`; the launcher takes its task from there
    (`--tf_config`). `restartPolicy: ExitCode` recreates a pod whose exit code is 128 or
    more and fails the job on 1 to 127, so the launcher reports with `--exit_codes=tfjob`
    (`distrib_tf.exit_codes.for_tfjob`): a crash, a dead peer (1) and a preemption (75)
    become retryable; bad input (2) and a NaN stop (65) stay permanent. Under ExitCode the
    operator recreates pods rather than restarting containers, and its `backoffLimit`
    counts container restarts only: nothing bounds the restarts (`--max_restarts` is not
    used; watch the job's events). Storage: `--volume_claim` is mounted in every pod at
    `/runs/` with the pod's name as its sub-path (ReadWriteMany), its own disk.
    """
    _check_evaluator(spec, "tfjob", volume_claim)
    del max_restarts  # See above: the operator has nothing to bound restarts under ExitCode.
    labels = {"app.kubernetes.io/name": name}
    runs = {"name": "runs", "mountPath": RUNS}
    if volume_claim:
        runs["subPathExpr"] = "$(POD_NAME)"
    container = {
        "name": TFJOB_CONTAINER, "image": image,
        "command": ["distrib-tf-launch", "--tf_config", "--exit_codes=tfjob",
                    f"--grace_period={launcher_grace(grace_seconds)}", "--", *command],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"containerPort": port, "name": "tfjob-port"}],
        "volumeMounts": [runs],
    }
    if gpus_per_task:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_task}}
    runs_volume = ({"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}} if volume_claim
                   else {"name": "runs", "emptyDir": {}})
    replicas = {}
    for job, addresses in spec.jobs.items():
        replicas[_TFJOB_TYPES[job]] = {
            "replicas": len(addresses), "restartPolicy": "ExitCode",
            "template": {"metadata": {"labels": labels}, "spec": {
                "containers": [container], "terminationGracePeriodSeconds": grace_seconds,
                "volumes": [runs_volume]}},
        }
    return [{"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": name, "labels": labels},
             "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "tfReplicaSpecs": replicas}}]
