"""Run the same job on an engine you already have: Kubernetes manifests, Slurm scripts.

Usage:

    python -m distrib_tf.export kubernetes --cluster_spec=PATH --image=IMAGE
        [--name=NAME] [--port=2222] [--gpus_per_task=N] [--out=FILE] -- COMMAND ...
    python -m distrib_tf.export slurm --cluster_spec=PATH [--out=FILE] -- COMMAND ...

`kubernetes` writes a ConfigMap holding the spec, a headless Service and an Indexed Job
with one pod per task of the spec. Pod `i` runs `distrib-tf-launch --task_ordinal=i`:
the launcher gives it the `TF_CONFIG` of the spec's i-th task, with each task's address
replaced by its pod's stable DNS name (`NAME-i.NAME:PORT`). Failed pods are retried
(`backoffLimit` = `--max_restarts`); a pod that exits 75 (preempted, its state saved) is
recreated without counting against that limit, and one that exits 2 (bad input) or 65
(a NaN or Inf loss) fails the Job at once (`podFailurePolicy`). `/runs` in every pod is the volume claim
`--volume_claim` (put `--model_dir` under it: backups must outlive the pod), else an
`emptyDir` that dies with the pod, with a warning.

`slurm` writes a batch script that runs one task per Slurm task through
`distrib-tf-launch --slurm`; it asks Slurm for SIGTERM two minutes before a time limit or
preemption (`--signal=TERM@120`) and requeues itself when the job exits 75.

This module imports no TensorFlow.
"""

import json
import shlex
import sys

import yaml

from distrib_tf import cli
from distrib_tf.cluster import ClusterSpec

EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # distrib_tf.launch's and distrib_tf.preemption's.
EXIT_NONFINITE = 65  # distrib_tf.nonfinite's: retrying resumes into the same NaN.
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
                    "--task_ordinal=$(JOB_COMPLETION_INDEX)", "--", *command],
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
                                                      "values": [EXIT_PREEMPTED]}},
                 {"action": "FailJob", "onExitCodes": {"containerName": "task", "operator": "In",
                                                       "values": [EXIT_USAGE, EXIT_NONFINITE]}},
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


def slurm_script(spec: ClusterSpec, *, command: list[str], job_name: str = "distrib_tf") -> str:
    """An `sbatch` script running one Slurm task per training task of `spec`."""
    tasks = spec.num_workers
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --ntasks={tasks}",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --signal=TERM@120",
        "#SBATCH --requeue",
        "# One TensorFlow task per Slurm task; TF_CONFIG comes from the SLURM_* variables.",
        "# --kill-on-bad-exit stops every task when one fails. SIGTERM (120 s before a time",
        f"# limit or a preemption) makes every worker back up one agreed step and exit {EXIT_PREEMPTED};",
        "# the job then requeues itself and resumes at that step (backups on each node's disk).",
        "srun --kill-on-bad-exit=1 distrib-tf-launch --slurm -- " + shlex.join(command),
        "code=$?",
        f'if [ "$code" -eq {EXIT_PREEMPTED} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"',
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="distrib-tf-export", description="Write the job for an existing engine.")
    engines = parser.add_subparsers(dest="engine", required=True, parser_class=cli.Parser)
    kube = engines.add_parser("kubernetes", help="an Indexed Job, a headless Service, a volume")
    kube.add_argument("--image", required=True, help="the container image that holds distrib_tf")
    kube.add_argument("--name", default="distrib-tf", help="name of the Job and the Service")
    kube.add_argument("--port", type=int, default=2222, help="every task's gRPC port")
    kube.add_argument("--gpus_per_task", type=int, default=0, help="nvidia.com/gpu per pod")
    kube.add_argument("--max_restarts", type=int, default=3, help="failed pods retried (backoffLimit)")
    kube.add_argument("--volume_claim", help=f"PersistentVolumeClaim mounted at {RUNS} for --model_dir")
    slurm = engines.add_parser("slurm", help="an sbatch script with signal and requeue")
    slurm.add_argument("--job_name", default="distrib_tf", help="sbatch --job-name")
    for engine in (kube, slurm):
        engine.add_argument("--cluster_spec", required=True,
                            help="a JSON spec or a shipped spec's name: how many tasks of each type")
        engine.add_argument("--out", help="write there (default: standard output)")
        engine.add_argument("command", nargs=cli.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = cli.command_after(args.command)
    try:
        if not command:
            raise ValueError("Missing command. Expected `-- COMMAND ...`, for example "
                             "`-- python -m distrib_tf.train`.")
        spec = ClusterSpec.load(args.cluster_spec)
        if args.engine == "kubernetes":
            if not 0 < args.port < 65536:
                raise ValueError(f"Invalid value for `--port`. Received: {args.port}. "
                                 "Expected a port number from 1 to 65535.")
            if args.max_restarts < 0:
                raise ValueError(f"Invalid value for `--max_restarts`. Received: {args.max_restarts}. "
                                 "Expected an integer >= 0.")
            if not args.volume_claim:
                print(f"distrib-tf-export: warning: no --volume_claim: {RUNS} is an emptyDir that "
                      "dies with its pod, so a recreated pod cannot resume", file=sys.stderr)
            text = yaml.safe_dump_all(kubernetes_manifests(
                spec, name=args.name, image=args.image, command=command, port=args.port,
                gpus_per_task=args.gpus_per_task, max_restarts=args.max_restarts,
                volume_claim=args.volume_claim), sort_keys=False)
        else:
            text = slurm_script(spec, command=command, job_name=args.job_name)
    except ValueError as e:
        print(f"distrib-tf-export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
