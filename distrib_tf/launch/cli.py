"""Start the tasks of a cluster spec on this host and keep the job alive through failures.

Usage:

    python -m distrib_tf.launch --workers=N -- COMMAND ...
    python -m distrib_tf.launch --cluster_spec=PATH_OR_NAME [--task=TYPE:INDEX]
        [--max_restarts=N] [--log_dir=DIR] [--gpus_per_task=N]
        [--collective_timeout=SECONDS] [--grace_period=SECONDS] -- COMMAND ...

`--workers=N` starts N workers on 127.0.0.1; `--cluster_spec` takes a JSON file or the
name of a spec shipped with distrib_tf (`local_2workers`, see `distrib_tf/cluster_specs/`).
Every task of the spec whose host is an address of this machine is started (or only the
one named by `--task`, or the spec's N-th with `--task_ordinal=N`: one launcher per host
on several hosts; or, with `--slurm` inside `srun`, the task of this Slurm task, its
cluster read from the `SLURM_*` variables), each with:

- `TF_CONFIG`: the spec with `:0` ports replaced by free ports (the same for every task
  of one attempt; new ones for each restart) and the task's own type and index. A port
  another process takes between the pick and TensorFlow's bind starts the group again
  with fresh ports, without spending a restart. Port 0 is refused where launchers would
  pick independently (`--task`, `--task_ordinal`, a spec with other hosts);
- `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (`SLURM_LOCALID` under Slurm, else its order among
  this launcher's tasks, from `--local_rank_offset=K` among `--local_world_size=M` when
  several launchers share the host, as a sweep's trials side by side do), and
  `CUDA_VISIBLE_DEVICES`: with `--gpus_per_task=N` local rank r gets GPUs r*N ...
  r*N+N-1 of those the launcher was given (its own `CUDA_VISIBLE_DEVICES` when set); with
  several local tasks and no flag the GPUs are split evenly, or refused in one line when
  they do not divide (`distrib_tf.launch.placement`);
- with several local tasks, each its share of this launcher's CPUs: bound to them, with
  `OMP_NUM_THREADS`, `TF_NUM_INTRAOP_THREADS` and `TF_NUM_INTEROP_THREADS` sized to them;
  a variable already set wins, and `--no_cpu_binding` leaves CPUs and threads alone;
- `DISTRIB_TF_COLLECTIVE_TIMEOUT`, with `--collective_timeout`: `make_strategy()`
  then fails a stuck all-reduce after that many seconds instead of hanging.

When this launcher runs every task of a spec whose addresses are all loopback, the
tasks run in a private network namespace (`--network=private`, the default: loopback
only): TensorFlow's gRPC servers listen on every interface, so without it anyone who can
reach this machine can reach the workers. The tasks then have no network access either:
a task that needs it (`gs://` data, a download) needs `--network=host`, which shares this
machine's network and exposes the servers, with a warning; a task that fails on an
unreachable network is answered with that choice. Where the kernel refuses a namespace,
a warning says the job is exposed.

With `DISTRIB_TF_FORKSERVER` naming the socket of a fork server of the tasks' interpreter
(`python -m distrib_tf.launch.forkserver SOCKET`, which imports Keras and TensorFlow once),
each task whose command it can run is forked from it instead of started anew: TensorFlow's
start-up (about 10 s a task) is paid once for every task and restart (the test suite's use).

Output is prefixed line by line (`[worker:1] ...`) and, with `--log_dir`, also written
to one file per task (`worker_1.log`, appended across restarts). TensorFlow's C++ logs
run at errors only (`TF_CPP_MIN_LOG_LEVEL=2` unless set), without the `cuInit` error of
every machine without a GPU driver; `--verbose` leaves them at TensorFlow's own level.
Every task also writes events (JSON lines, `distrib_tf.events`) to a pipe of its own:
on a terminal they feed one live status line under the output (epoch, step, examples/s,
ETA, the slowest worker's step time); elsewhere a plain status line every 30 s; with
`--events=FILE` they are all appended to FILE, the launcher's own included.

Failures: when a task exits non-zero or is killed, the others are stopped (SIGTERM,
then SIGKILL after `--grace_period`: multi-worker TensorFlow can ignore SIGTERM) and,
while restarts remain, the group starts again; the job resumes from its backup. A task
that exits with 2 (bad input) or 65 (the main job stopped on a NaN or Inf loss) is not
restarted: it would fail again. The root cause is
reported: the task that failed first, its exit code or signal, and its last lines of
output. If the launcher itself is killed, the kernel kills its tasks (Linux parent-death
signal).

Preemption: SIGTERM to the launcher (Slurm's and Kubernetes' notice), or SIGHUP (the ssh
session or terminal that started it gone), is sent on to every task as SIGTERM; the main
job's workers then agree on one step, each backs it up and exits with 75
(`distrib_tf.keras.preemption`), and the launcher exits with 75: started again, the job
resumes at that step. The launcher exits 75 only when every task exited 75 (or had
finished); otherwise it names each task's code in one line and exits 130. A task that
exits with 75 on its own (it got the SIGTERM) ends the launch the same way. Ctrl-C stops
the whole group the same way and exits 130. Started by a sweep (`DISTRIB_TF_PARENT_PID`),
the launcher gets SIGTERM when the sweep dies, so its trial backs up and stops as well.
Signal handlers only record the signal; the supervision loop acts on it.

Exit codes (`distrib_tf.exit_codes`): 0 every task succeeded; 1 a task failed and no
restarts remain; 2 bad input (nothing started, or a task reported bad input); 3 (a sweep's
trial only) the sweep pruned it, every worker saved its state; 65 the main
job stopped on a NaN or Inf loss; 75
preempted, the state is saved, start again to resume; 130 interrupted by Ctrl-C (or
SIGTERM to a job that did not save).

This module imports no TensorFlow.
"""


import argparse
import os
import shutil
import sys
import tempfile

from distrib_tf import argparsing
from distrib_tf import cluster
from distrib_tf import exit_codes
from distrib_tf import lifeline
from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import Task
from distrib_tf.cluster import parse_task
from distrib_tf.cluster import shipped_specs
from distrib_tf.deploy import slurm
from distrib_tf.launch import placement
from distrib_tf.launch.supervise import LaunchConfig
from distrib_tf.launch.supervise import run
from distrib_tf.launch.supervise import task_placement


def command_line(cluster_spec: str, command: list[str], *, max_restarts: int = 0,
                 grace_period: float = 10.0, log_dir: str | None = None,
                 events: str | None = None) -> list[str]:
    """The command that runs `command` on every local task of `cluster_spec`. Pure.

    Example:

        >>> command_line("spec.json", ["python", "job.py"])[1:4]
        ['-m', 'distrib_tf.launch', '--cluster_spec=spec.json']
    """
    options = [f"--cluster_spec={cluster_spec}", f"--max_restarts={max_restarts}",
               f"--grace_period={grace_period}"] + ([f"--log_dir={log_dir}"] if log_dir else []) + (
                   [f"--events={events}"] if events else [])
    return [sys.executable, "-m", "distrib_tf.launch", *options, "--", *command]


def main_job_command(model_dir: str, flags: list[str]) -> list[str]:
    """The main job (`python -m distrib_tf.train`) writing into `model_dir`. Pure."""
    return [sys.executable, "-m", "distrib_tf.train", f"--model_dir={model_dir}", *flags]


# Command line -------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"Received: {text!r}. Expected an integer >= 1")
    return int(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparsing.Parser(
        prog="distrib-tf-launch", description="Start the tasks of a cluster spec on this host.",
        epilog="Example: distrib-tf-launch --workers=2 -- python my_script.py")
    parser.add_argument("--cluster_spec", help="a JSON spec file, or the name of a shipped spec ("
                        + ", ".join(shipped_specs()) + ")")
    parser.add_argument("--workers", type=_positive_int, metavar="N",
                        help="N local workers on 127.0.0.1, without a spec file")
    parser.add_argument("--task", metavar="TYPE:INDEX", help="start only this task")
    parser.add_argument("--task_ordinal", type=int,
                        help="start only the spec's N-th task (chief, workers, evaluator order)")
    parser.add_argument("--tf_config", action="store_true",
                        help="the cluster and this task come from TF_CONFIG (a TFJob's pod)")
    parser.add_argument("--exit_codes", choices=("ours", "tfjob"), default="ours",
                        help="tfjob: 128 + code for what a retry can cure (distrib_tf.exit_codes.for_tfjob)")
    parser.add_argument("--slurm", action="store_true",
                        help="inside srun: the cluster and this task come from SLURM_*")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="restart the whole group this often after a task fails")
    parser.add_argument("--log_dir", help="also append each task's output to DIR/TYPE_INDEX.log")
    parser.add_argument("--gpus_per_task", type=int, default=0,
                        help="GPUs for each local task (0: split the visible GPUs evenly)")
    parser.add_argument("--local_rank_offset", type=int, default=0, metavar="K",
                        help="this launcher's tasks are local ranks K, K+1, ... of the host (default: 0); "
                             "with --local_world_size, launchers side by side (a sweep's trials) share "
                             "the host's GPUs and CPUs out disjointly")
    parser.add_argument("--local_world_size", type=int, default=0, metavar="M",
                        help="the tasks of every launcher on this host (default: this launcher's)")
    parser.add_argument("--no_cpu_binding", action="store_true",
                        help="do not share this host's CPUs and thread pools out among local tasks")
    parser.add_argument("--collective_timeout", type=float,
                        help="seconds before a stuck all-reduce fails (default: never)")
    parser.add_argument("--grace_period", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping tasks")
    parser.add_argument("--events", metavar="FILE",
                        help="append every task's events (JSON lines, distrib_tf.events) to FILE")
    parser.add_argument("--verbose", action="store_true",
                        help="every worker's lines, and TensorFlow's C++ logs at their own level (default: "
                             "the chief speaks for the job; errors only)")
    parser.add_argument("--network", choices=("private", "host"), default="private",
                        help="for a loopback-only spec: private (a network namespace of their own, "
                             "loopback only: unreachable, and without network access) or host "
                             "(this machine's network: reachable from it, with a warning)")
    parser.add_argument("--no_private", action="store_true", help="the same as --network=host")
    parser.add_argument("command", nargs=argparsing.REMAINDER, help="-- COMMAND ...")
    return parser.parse_args(argv)


def _select_tasks(args: argparse.Namespace) -> tuple[ClusterSpec, tuple[Task, ...]]:
    """The cluster and the tasks this launcher starts, from --slurm, --task, or this host."""
    if args.slurm:
        if (args.cluster_spec or args.workers or args.task or args.task_ordinal is not None
                or args.max_restarts):
            raise ValueError("Invalid arguments with `--slurm`: the cluster and the task come "
                             "from SLURM_*, and restarts are Slurm's (`srun --wait`, "
                             "requeue). Expected no --cluster_spec, --workers, --task, --task_ordinal or "
                             "--max_restarts.")
        spec, task = slurm.load_cluster()
        return spec, (task,)
    if args.tf_config:
        if args.cluster_spec or args.workers or args.task or args.task_ordinal is not None or args.slurm:
            raise ValueError("Invalid arguments with `--tf_config`: the cluster and the task come "
                             "from TF_CONFIG. Expected no --cluster_spec, --workers, --task, "
                             "--task_ordinal or --slurm.")
        loaded = cluster.load_tf_config()
        if loaded is None:
            raise ValueError("Missing TF_CONFIG with `--tf_config`. Expected the TF_CONFIG that "
                             "a TFJob's operator sets in each pod.")
        spec, task = loaded
        _refuse_free_ports(spec, "--tf_config")
        return spec, (task,)
    if args.workers and args.cluster_spec:
        raise ValueError("Invalid arguments: both `--workers` and `--cluster_spec`. Expected one: "
                         "--workers=N for N local workers, or a spec.")
    if args.workers:
        spec = ClusterSpec.local_workers(args.workers)
        return spec, spec.tasks
    if not args.cluster_spec:
        raise ValueError("Missing `--cluster_spec` or `--workers`. Expected --workers=N for N local "
                         "workers, a spec such as --cluster_spec=local_2workers, or --slurm inside srun.")
    spec = ClusterSpec.load(args.cluster_spec)
    if args.task:
        task = spec.check_task(parse_task(args.task))
        _refuse_free_ports(spec, "--task")
        return spec, (task,)
    if args.task_ordinal is not None:
        if not 0 <= args.task_ordinal < len(spec.tasks):
            raise ValueError(f"Invalid value for `--task_ordinal`. Received: {args.task_ordinal}. "
                             f"Expected 0 to {len(spec.tasks) - 1} for the tasks of {spec.source}.")
        _refuse_free_ports(spec, "--task_ordinal")
        return spec, (spec.tasks[args.task_ordinal],)
    tasks = spec.local_tasks()
    if not tasks:
        raise ValueError(
            f"No task of {args.cluster_spec} lives on this host: none of its addresses "
            "is an address of this machine. Pass --task=TYPE:INDEX to name this host's task.")
    if set(tasks) != set(spec.tasks):
        _refuse_free_ports(spec, "a spec with tasks on other hosts")
    return spec, tasks


def _refuse_free_ports(spec: ClusterSpec, why: str) -> None:
    """Port 0 works only when one launcher starts every task: the others cannot know it."""
    for task in spec.tasks:
        if spec.address(task).endswith(":0"):
            raise ValueError(
                f"Invalid value for `{task}` in {spec.source}. Received: {spec.address(task)!r} "
                f"with {why}. Expected a fixed port: each launcher would pick its own for port 0.")


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validates the arguments; raises `ValueError` with one line on bad input."""
    command = argparsing.command_after(args.command)
    if not command:
        raise ValueError("Missing command. Expected `-- COMMAND ...` after the options, "
                         "for example `-- python -m distrib_tf.train`.")
    if shutil.which(command[0]) is None:
        raise ValueError(f"Invalid value for `COMMAND`. Received: {command[0]!r}. "
                         "Expected a program on PATH or a path to an executable.")
    for name in ("max_restarts", "gpus_per_task", "local_rank_offset", "local_world_size"):
        if getattr(args, name) < 0:
            raise ValueError(f"Invalid value for `--{name}`. Received: {getattr(args, name)}. "
                             "Expected an integer >= 0.")
    if args.collective_timeout is not None and not args.collective_timeout > 0:
        raise ValueError(f"Invalid value for `--collective_timeout`. Received: "
                         f"{args.collective_timeout}. Expected a number of seconds > 0.")
    if args.events and not os.access(os.path.dirname(os.path.abspath(args.events)), os.W_OK):
        raise ValueError(f"Invalid value for `--events`. Received: {args.events!r}. Expected a file in "
                         "an existing directory this user can write to.")
    if not args.grace_period >= 0:
        raise ValueError(f"Invalid value for `--grace_period`. Received: {args.grace_period}. Expected a number "
                         "of seconds >= 0.")
    if args.log_dir:  # Before any task starts: a log that cannot be opened would fail the later ones only.
        try:
            os.makedirs(args.log_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.log_dir):
                pass
        except OSError as e:
            raise ValueError(f"Invalid value for `--log_dir`. Received: {args.log_dir!r}. Expected a directory "
                             f"this user can write to ({e.strerror}).") from e
    spec, tasks = _select_tasks(args)
    if args.local_world_size and args.local_rank_offset + len(tasks) > args.local_world_size:
        raise ValueError(f"Invalid value for `--local_world_size`. Received: {args.local_world_size}, with "
                         f"--local_rank_offset={args.local_rank_offset} and {len(tasks)} task(s) here. Expected at "
                         f"least {args.local_rank_offset + len(tasks)}.")
    config = LaunchConfig(spec=spec, tasks=tasks, command=tuple(command),
                          max_restarts=args.max_restarts, log_dir=args.log_dir,
                          gpus_per_task=args.gpus_per_task, local_rank_offset=args.local_rank_offset,
                          local_world_size=args.local_world_size,
                          collective_timeout=args.collective_timeout,
                          grace_period=args.grace_period,
                          private=args.network == "private" and not args.no_private,
                          visible_gpus=tuple(placement.visible_gpus(os.environ)),
                          cpus=() if args.no_cpu_binding else tuple(sorted(os.sched_getaffinity(0))),
                          events_path=args.events, verbose=args.verbose)
    for slot in range(len(tasks)):  # Placement errors now, before anything starts.
        task_placement(config, slot, dict(os.environ))
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(args)
    except ValueError as e:  # ClusterSpecError included.
        print(f"distrib-tf-launch: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    lifeline.die_with_parent()  # Started by a sweep: its tasks back up and stop when the sweep dies.
    result = run(config)
    if result.exit_code == exit_codes.FAILED:
        print(f"distrib-tf-launch: job failed after {result.attempts} attempt(s); first "
              f"failure: {result.first_failure.describe()}", file=sys.stderr)
    return exit_codes.for_tfjob(result.exit_code) if args.exit_codes == "tfjob" else result.exit_code

