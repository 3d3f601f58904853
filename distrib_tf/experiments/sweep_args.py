"""The flags of `distrib-tf-sweep` (`distrib_tf.experiments.sweep` reads them): what a sweep
runs and where, each checked against the others (`check`) before anything starts. This
module imports no TensorFlow.
"""

import dataclasses
import json
import math
import os
import shlex
import sys

from distrib_tf import argparsing
from distrib_tf import study as study_lib
from distrib_tf.cluster import ClusterSpec
from distrib_tf.experiments import sweep_engines
from distrib_tf.experiments import sweep_kubernetes
from distrib_tf.experiments.sweep_space import SWEEPABLE
from distrib_tf.experiments.sweep_space import grid_size
from distrib_tf.experiments.sweep_space import parse_space
from distrib_tf.experiments.sweep_study import PRUNERS
from distrib_tf.experiments.sweep_study import optuna_module


def command_of(after: list[str]) -> tuple[list[str], bool]:
    """The trial's program, and whether it is the main job (nothing, or only its flags, after `--`)."""
    if not after or after[0].startswith("-"):
        return [sys.executable, "-m", "distrib_tf.train", *after], True
    if after[0] in ("python", "python3"):  # The sweep's own interpreter: the one with distrib_tf.
        return [sys.executable, *after[1:]], False
    return after, False


def program_of(command: list[str], main_job: bool) -> str:
    """What a sweep's trials run, as its study records it: the main job, a script's absolute
    path (its flags may change between runs of the sweep), or the program's name."""
    if main_job:
        return "distrib_tf.train"
    if command[0] == sys.executable and len(command) > 1 and command[1].endswith(".py"):
        return os.path.abspath(command[1])
    return shlex.join(command[:2] if command[0] == sys.executable else command[:1])


def parse_args(argv: list[str]):
    parser = argparsing.Parser(
        prog="distrib-tf-sweep", description="Sweep the hyperparameters of your script (or the main job's flags); "
        "every trial a distributed run.",
        epilog="Example: distrib-tf-sweep --space='learning_rate=loguniform(1e-4,1e-2) units=[32,64]' "
               "--sampler=tpe --trials=8 --pruner=median -- python my_script.py")
    parser.add_argument("--space", default="", help="NAME=VALUES items: [a,b], linspace(a,b,n), logspace(a,b,n), "
                        "uniform(a,b), loguniform(a,b), int(a,b), logint(a,b); NAME as the script's "
                        "distrib_tf.params(...) declares it (the main job: " + ", ".join(sorted(SWEEPABLE)) + ")")
    parser.add_argument("--space_file", help="the same as a JSON object, merged under --space")
    parser.add_argument("--sampler", default="grid", choices=("grid", "random", "tpe"),
                        help="Optuna's sampler (default: grid, in the order written)")
    parser.add_argument("--trials", type=int, help="how many trials (required for random and tpe; "
                        "caps the grid; default: the whole grid)")
    parser.add_argument("--pruner", default="none", choices=PRUNERS,
                        help="Optuna's pruner, fed each epoch's metric (default: none)")
    parser.add_argument("--pruner_startup_trials", type=int, default=2,
                        help="median: trials that end before any is pruned (default: 2)")
    parser.add_argument("--pruner_warmup_epochs", type=int, default=0,
                        help="median: epochs before a trial can be pruned; halving, hyperband: the "
                             "first rung's epochs (default: 0, i.e. 1)")
    parser.add_argument("--promote", action="store_true",
                        help="with --pruner=halving or hyperband: pause a trial at a rung where it does not "
                             "rank, and promote it from its backup, at its step, once it ranks there (ASHA with "
                             "promotion; --trials counts new values)")
    parser.add_argument("--reduction_factor", type=int,
                        help="halving, hyperband: the share of a rung's trials that go on is 1/this (default: "
                             "Optuna's, 4 for halving and 3 for hyperband; with --promote, 3)")
    parser.add_argument("--engine", default="local", choices=sweep_engines.ENGINES,
                        help="where trials run: local (this host's slots), slurm (each trial a batch job "
                             "of `distrib-tf-export slurm`, through sbatch, squeue, scontrol and scancel), "
                             "kubernetes (each an Indexed Job of `distrib-tf-export kubernetes`, through kubectl) "
                             "or ray (each a Ray Train run of distrib-tf-ray, through Ray's job API); off the "
                             "host, the study in PostgreSQL or a shared journal file")
    parser.add_argument("--image", help="--engine=kubernetes: the trials' container image (distrib_tf and the "
                        "script in it, or the script on the claim)")
    parser.add_argument("--volume_claim", help="--engine=kubernetes: a ReadWriteMany PersistentVolumeClaim that "
                        "every trial's pods mount at --claim_mount; --sweep_dir must be on it")
    parser.add_argument("--claim_mount", default="/runs", help="--engine=kubernetes: where --volume_claim is "
                        "mounted, in the trials' pods as here (default: /runs)")
    parser.add_argument("--ray_address", help="--engine=ray: the Ray cluster's dashboard, whose job API takes "
                        "the trials (default: RAY_ADDRESS, else a cluster on this host)")
    parser.add_argument("--nodes_per_trial", type=int, help="--engine=slurm: spread each trial's workers over "
                        "this many nodes (default: where Slurm puts them)")
    parser.add_argument("--cluster_spec", default="local_2workers",
                        help="the slots: the local tasks of a spec file or a shipped spec's name "
                             "(default: local_2workers)")
    parser.add_argument("--workers_per_trial", type=int,
                        help="workers of each trial, on 127.0.0.1 (default: every task of the spec, "
                             "one trial at a time; on an engine: the spec's task count)")
    parser.add_argument("--parallel", type=int,
                        help="at most this many trials at once (default: as many as the slots hold; on an "
                        "engine: 1)")
    parser.add_argument("--sweep_dir", default="runs/sweep", help="trials and results go there (default: runs/sweep)")
    parser.add_argument("--storage", help="the study: sqlite:///PATH (default: SWEEP_DIR/study.db), "
                        "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE, or journal:PATH (a file on a "
                        "disk every host shares)")
    parser.add_argument("--study_name", default="distrib_tf", help="the study's name in --storage (default: "
                        "distrib_tf)")
    parser.add_argument("--metric", default="val_accuracy", help="the objective: a metric of the run's epochs "
                        "(default: val_accuracy)")
    parser.add_argument("--mode", default="max", choices=("max", "min"), help="whether a larger metric is better")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random and tpe samplers (default: 0)")
    parser.add_argument("command", nargs=argparsing.REMAINDER,
                        help="-- python my_script.py [ARGS] (default: the main job; -- --flag=value: its flags)")
    return parser.parse_args(argv)


def read_space_file(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read search space {path}: {e}. Expected a JSON object of names.") from e
    if not isinstance(data, dict):
        raise ValueError(f"Invalid search space in {path}. Received: {type(data).__name__}. "
                         "Expected a JSON object of names.")
    return data


def check_positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"Invalid value for `{flag}`. Received: {value}. Expected an integer >= 1.")


def make_engine(name: str, *, workers: int, nodes: int = 0, ray_address: str | None = None,
                image: str | None = None, volume_claim: str | None = None, claim_mount: str = "/runs"):
    """The engine called `name`, checked: `None` for the host's own slots (`local`).

    Raises:
        ValueError: its commands are missing, or a flag it cannot take (one line).
    """
    if name == "local":
        if nodes:
            raise ValueError(f"Invalid value for `--nodes_per_trial`. Received: {nodes}. Expected it only with "
                             "an engine that spreads a trial over nodes (--engine=slurm).")
        return None
    if nodes and name != "slurm":
        raise ValueError(f"Invalid value for `--nodes_per_trial`. Received: {nodes}. Expected it only with "
                         "--engine=slurm (Kubernetes and Ray place a trial's tasks themselves).")
    if name == "slurm":
        engine = sweep_engines.SlurmEngine(workers=workers, nodes=nodes)
    elif name == "ray":
        engine = sweep_engines.RayEngine(workers=workers, address=ray_address)
    else:
        engine = sweep_kubernetes.KubernetesEngine(workers=workers, image=image or "", volume_claim=volume_claim or "",
                                                   mount=claim_mount)
    engine.check()
    return engine


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a sweep's flags make, checked (`check`)."""

    space: list  # The search space's dimensions (`sweep_space`).
    total: int | float  # Trials to run (a grid: its size at most).
    command: list[str]  # Each trial's program.
    main_job: bool  # Whether that is the main job.
    slots: int  # The spec's local tasks, or its task count on an engine.
    per_trial: int  # Workers of each trial.
    engine: object  # `make_engine`'s: None for the host's own slots.
    url: str  # The study's storage.


def check(args) -> Plan:
    """Every flag checked against the others, before anything starts.

    Raises:
        ValueError: one line naming the flag, what it received and what it expects.
    """
    command, main_job = command_of(argparsing.command_after(args.command))
    space = parse_space(args.space, read_space_file(args.space_file), SWEEPABLE if main_job else None)
    for value, flag in ((args.trials, "--trials"), (args.workers_per_trial, "--workers_per_trial"),
                        (args.parallel, "--parallel")):
        check_positive(value, flag)
    if args.sampler != "grid" and args.trials is None:
        raise ValueError(f"Missing `--trials` for --sampler={args.sampler}. Expected a budget >= 1.")
    total = min(grid_size(space), args.trials or math.inf) if args.sampler == "grid" else args.trials
    check_positive(args.nodes_per_trial, "--nodes_per_trial")
    if args.promote and args.pruner not in ("halving", "hyperband"):
        raise ValueError(f"Invalid value for `--pruner` with --promote. Received: {args.pruner}. Expected "
                         "halving or hyperband, whose rungs pause and promote a trial.")
    if args.reduction_factor is not None and args.reduction_factor < 2:
        raise ValueError(f"Invalid value for `--reduction_factor`. Received: {args.reduction_factor}. "
                         "Expected an integer >= 2.")
    off_host = args.engine != "local"
    spec = ClusterSpec.load(args.cluster_spec)
    slots = spec.num_workers if off_host else len(spec.local_tasks())
    if not slots:
        raise ValueError(f"No task of {args.cluster_spec} lives on this host. Expected a local spec "
                         "for sweep trials, such as local_2workers.")
    per_trial = args.workers_per_trial or slots
    if per_trial > slots and not off_host:
        raise ValueError(f"Invalid value for `--workers_per_trial`. Received: {per_trial}. Expected at most "
                         f"the {slots} local tasks of {args.cluster_spec}.")
    engine = make_engine(args.engine, workers=per_trial, nodes=args.nodes_per_trial or 0,
                         ray_address=args.ray_address, image=args.image, volume_claim=args.volume_claim,
                         claim_mount=args.claim_mount)
    script = command[1] if not main_job and command[0] == sys.executable and len(command) > 1 else ""
    if script.endswith(".py") and not os.path.exists(script):
        raise ValueError(f"Cannot find the script {script}. Expected -- python PATH/TO/SCRIPT.py.")
    if args.engine == "ray" and not main_job and not script.endswith(".py"):
        raise ValueError(f"Invalid value for `COMMAND` with --engine=ray. Received: {shlex.join(command)}. "
                         "Expected -- python PATH/TO/SCRIPT.py (distrib-tf-ray runs a Python script or the "
                         "main job).")
    if script.endswith(".py") and off_host:  # The engine's tasks start elsewhere.
        command[1] = os.path.abspath(script)
    optuna_module()
    url = study_lib.parse_url(args.storage) if args.storage else study_lib.default_url(args.sweep_dir)
    if off_host and url.startswith("sqlite:"):
        raise ValueError(f"Invalid value for `--storage`. Received: {study_lib.hide_password(url)}"
                         f"{'' if args.storage else ' (the default)'} with --engine={args.engine}. Expected "
                         "a study every node reaches: postgresql+psycopg://USER@HOST:PORT/DATABASE, or "
                         "journal:PATH on a disk every node shares.")
    if args.engine == "kubernetes":
        engine.check_paths(sweep_dir=args.sweep_dir, storage=url)
    return Plan(space, total, command, main_job, slots, per_trial, engine, url)
