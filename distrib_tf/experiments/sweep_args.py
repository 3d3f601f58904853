"""The flags of `distrib-tf-sweep` (`distrib_tf.experiments.sweep` reads them): what a sweep
runs and where. This module imports no TensorFlow.
"""

import json
import os
import shlex
import sys

from distrib_tf import argparsing
from distrib_tf.experiments import sweep_engines
from distrib_tf.experiments.sweep_space import SWEEPABLE
from distrib_tf.experiments.sweep_study import PRUNERS


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
                             "of `distrib-tf-export slurm`, through sbatch, squeue, scontrol and scancel) or ray "
                             "(each a Ray Train run of distrib-tf-ray, through Ray's job API); off the host, the "
                             "study in PostgreSQL or a shared journal file")
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
