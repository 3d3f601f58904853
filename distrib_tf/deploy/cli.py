"""`distrib-tf-export`: the same job on an engine you already run.

Usage:

    distrib-tf-export kubernetes --cluster_spec=PATH --image=IMAGE [--engine=job|jobset|trainjob|tfjob]
        [--name=NAME] [--port=2222] [--gpus_per_task=N] [--volume_claim=CLAIM] [--out=FILE] -- COMMAND ...
    distrib-tf-export slurm (--cluster_spec=PATH | --nodes=MIN-MAX [--tasks_per_node=1]) [--out=FILE] -- COMMAND ...

(`python -m distrib_tf.deploy` is the same.) What each engine gets: `distrib_tf.deploy.kubernetes`
and `distrib_tf.deploy.slurm`. Bad input is one line on stderr and exit code 2.
This module imports no TensorFlow.
"""

import sys

import yaml

from distrib_tf import argparsing
from distrib_tf import exit_codes
from distrib_tf.cluster import ClusterSpec
from distrib_tf.deploy import kubernetes
from distrib_tf.deploy import slurm


class _Dumper(yaml.SafeDumper):
    """Writes a value shared between places in full at each: no `&id001` anchors."""

    def ignore_aliases(self, data):
        return True


ENGINES = {"job": kubernetes.kubernetes_manifests, "jobset": kubernetes.jobset_manifests,
           "trainjob": kubernetes.trainjob_manifests, "tfjob": kubernetes.tfjob_manifests}


def main(argv: list[str] | None = None) -> int:
    parser = argparsing.Parser(prog="distrib-tf-export", description="Write the job for an existing engine.")
    engines = parser.add_subparsers(dest="target", required=True, parser_class=argparsing.Parser)
    kube = engines.add_parser("kubernetes", help="an Indexed Job, a headless Service, a volume")
    kube.add_argument("--image", required=True, help="the container image that holds distrib_tf")
    kube.add_argument("--name", default="distrib-tf", help="name of the Job and the Service")
    kube.add_argument("--port", type=int, default=2222, help="every task's gRPC port")
    kube.add_argument("--gpus_per_task", type=int, default=0, help="nvidia.com/gpu per pod")
    kube.add_argument("--max_restarts", type=int, default=3, help="failed pods retried (backoffLimit)")
    kube.add_argument("--volume_claim", help=f"PersistentVolumeClaim mounted at {kubernetes.RUNS} for --model_dir")
    kube.add_argument("--engine", choices=tuple(ENGINES), default="job",
                      help="job: a plain Indexed Job; jobset: a JobSet that restarts every pod together; "
                           "trainjob: a Kubeflow Trainer v2 TrainJob and its runtime; tfjob: a Kubeflow "
                           "Training Operator TFJob")
    slurm_parser = engines.add_parser("slurm", help="an sbatch script with signal and requeue")
    slurm_parser.add_argument("--job_name", default="distrib_tf", help="sbatch --job-name")
    slurm_parser.add_argument("--nodes", help="N or MIN-MAX: any allocation in that range, each requeue "
                                              "perhaps another size (instead of --cluster_spec)")
    slurm_parser.add_argument("--tasks_per_node", type=int, default=1, help="with --nodes: tasks on each node")
    for engine, required in ((kube, True), (slurm_parser, False)):
        engine.add_argument("--cluster_spec", required=required,
                            help="a JSON spec or a shipped spec's name: how many tasks of each type")
        engine.add_argument("--out", help="write there (default: standard output)")
        engine.add_argument("command", nargs=argparsing.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = argparsing.command_after(args.command)
    try:
        if not command:
            raise ValueError("Missing command. Expected `-- COMMAND ...`, for example "
                             "`-- python -m distrib_tf.train`.")
        spec = ClusterSpec.load(args.cluster_spec) if args.cluster_spec else None
        if args.target == "kubernetes":
            if not 0 < args.port < 65536:
                raise ValueError(f"Invalid value for `--port`. Received: {args.port}. "
                                 "Expected a port number from 1 to 65535.")
            if args.max_restarts < 0:
                raise ValueError(f"Invalid value for `--max_restarts`. Received: {args.max_restarts}. "
                                 "Expected an integer >= 0.")
            if not args.volume_claim:
                print(f"distrib-tf-export: warning: no --volume_claim: {kubernetes.RUNS} is an emptyDir that "
                      "dies with its pod, so a recreated pod cannot resume", file=sys.stderr)
            text = yaml.dump_all(ENGINES[args.engine](
                spec, name=args.name, image=args.image, command=command, port=args.port,
                gpus_per_task=args.gpus_per_task, max_restarts=args.max_restarts,
                volume_claim=args.volume_claim), Dumper=_Dumper, sort_keys=False)
        else:
            text = slurm.batch_script(spec, command=command, job_name=args.job_name, tasks_per_node=args.tasks_per_node,
                                      nodes=slurm.parse_nodes(args.nodes) if args.nodes else None)
    except ValueError as e:
        print(f"distrib-tf-export: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
