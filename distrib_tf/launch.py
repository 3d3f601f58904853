"""Start the tasks of a cluster spec on this host and keep the job alive through failures.

Usage:

    python -m distrib_tf.launch --cluster_spec=PATH [--task=TYPE:INDEX]
        [--max_restarts=N] [--log_dir=DIR] [--gpus_per_task=N]
        [--collective_timeout=SECONDS] [--grace_period=SECONDS] -- COMMAND ...

Every task of the spec whose host is an address of this machine is started (or only the
one named by `--task`, or the spec's N-th with `--task_ordinal=N`: one launcher per host
on several hosts; or, with `--slurm` inside `srun`, the task of this Slurm task, its
cluster read from the `SLURM_*` variables), each with:

- `TF_CONFIG`: the spec with `:0` ports replaced by free ports (the same for every task
  of one attempt; new ones for each restart) and the task's own type and index;
- `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (`SLURM_LOCALID` under Slurm, else its order among
  this launcher's tasks), and `CUDA_VISIBLE_DEVICES`: with `--gpus_per_task=N` local rank
  r gets GPUs r*N ... r*N+N-1 of those the launcher was given (its own
  `CUDA_VISIBLE_DEVICES` when set); with several local tasks and no flag the GPUs are
  split evenly, or refused in one line when they do not divide (`distrib_tf.placement`);
- `DISTRIB_TF_COLLECTIVE_TIMEOUT`, with `--collective_timeout`: `make_strategy()`
  then fails a stuck all-reduce after that many seconds instead of hanging.

When this launcher runs every task of a spec whose addresses are all loopback, the
tasks run in a private network namespace (loopback
only; `--no_private` turns that off): TensorFlow's gRPC servers listen on every
interface, so without it anyone who can reach this machine can reach the workers. The
tasks then have no network access. Where the kernel refuses a namespace, a warning
says the job is exposed.

Output is prefixed line by line (`[worker:1] ...`) and, with `--log_dir`, also written
to one file per task (`worker_1.log`, appended across restarts).

Failures: when a task exits non-zero or is killed, the others are stopped (SIGTERM,
then SIGKILL after `--grace_period`: multi-worker TensorFlow can ignore SIGTERM) and,
while restarts remain, the group starts again; the job resumes from its backup. A task
that exits with 2 (bad input) or 65 (the main job stopped on a NaN or Inf loss) is not
restarted: it would fail again. The root cause is
reported: the task that failed first, its exit code or signal, and its last lines of
output. If the launcher itself is killed, the kernel kills its tasks (Linux parent-death
signal).

Preemption: SIGTERM to the launcher (Slurm's and Kubernetes' notice) is forwarded to
every task; the main job's workers then agree on one step, each backs it up and exits
with 75 (`distrib_tf.preemption`), and the launcher exits with 75: started again, the
job resumes at that step. A task that exits with 75 on its own (it got the SIGTERM)
ends the launch the same way. Ctrl-C stops the whole group the same way and exits 130.
Signal handlers only record the signal; the supervision loop acts on it.

Exit codes: 0 every task succeeded; 1 a task failed and no restarts remain; 2 bad
input (nothing started, or a task reported bad input); 75 preempted, the state is
saved, start again to resume; 130 interrupted by Ctrl-C (or SIGTERM to a job that
did not save).

This module imports no TensorFlow.
"""

import argparse
import collections
import ctypes
import dataclasses
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from distrib_tf import placement
from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import Task
from distrib_tf.cluster import load_slurm_cluster
from distrib_tf.cluster import parse_task
from distrib_tf.cluster import split_address

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 75, 130
EXIT_NONFINITE = 65  # The main job's NaN/Inf stop: a restart would resume into it again.
TAIL_LINES = 20


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to start and how; validated by `config_from_args`."""

    spec: ClusterSpec
    tasks: tuple[Task, ...]
    command: tuple[str, ...]
    max_restarts: int = 0
    log_dir: str | None = None
    gpus_per_task: int = 0
    collective_timeout: float | None = None
    grace_period: float = 10.0
    private: bool = True
    visible_gpus: tuple[str, ...] = ()  # What the launcher was given, to share out.


@dataclasses.dataclass
class TaskExit:
    task: Task
    returncode: int
    tail: list[str]

    def describe(self) -> str:
        if self.returncode < 0:
            how = f"was killed by {signal.Signals(-self.returncode).name}"
        else:
            how = f"exited with code {self.returncode}"
        return f"{self.task} {how}"


@dataclasses.dataclass
class LaunchResult:
    """How a launch ended: the exit code and, on failure, the first task that failed."""

    exit_code: int
    attempts: int
    first_failure: TaskExit | None = None

    def is_failed(self) -> bool:
        return self.exit_code != EXIT_OK


def command_line(cluster_spec: str, command: list[str], *, max_restarts: int = 0,
                 grace_period: float = 10.0, log_dir: str | None = None) -> list[str]:
    """The command that runs `command` on every local task of `cluster_spec`. Pure.

    Example:

        >>> command_line("spec.json", ["python", "job.py"])[1:4]
        ['-m', 'distrib_tf.launch', '--cluster_spec=spec.json']
    """
    options = [f"--cluster_spec={cluster_spec}", f"--max_restarts={max_restarts}",
               f"--grace_period={grace_period}"] + ([f"--log_dir={log_dir}"] if log_dir else [])
    return [sys.executable, "-m", "distrib_tf.launch", *options, "--", *command]


def main_job_command(model_dir: str, flags: list[str]) -> list[str]:
    """The main job (`python -m distrib_tf.train`) writing into `model_dir`. Pure."""
    return [sys.executable, "-m", "distrib_tf.train", f"--model_dir={model_dir}", *flags]


def task_env(config: LaunchConfig, spec: ClusterSpec, task: Task, slot: int,
             base_env: dict[str, str]) -> dict[str, str]:
    """The environment of `task`, the `slot`-th task started on this host. Pure."""
    env = {**base_env, "TF_CONFIG": spec.tf_config(task), "PYTHONUNBUFFERED": "1"}
    local_rank, local_tasks = placement.slurm_local_rank(base_env) or (slot, len(config.tasks))
    env.update(placement.placement_env(local_rank=local_rank, local_tasks=local_tasks,
                                       visible=list(config.visible_gpus),
                                       gpus_per_task=config.gpus_per_task))
    if config.collective_timeout:
        env["DISTRIB_TF_COLLECTIVE_TIMEOUT"] = str(config.collective_timeout)
    return env


_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


def is_loopback_only(spec: ClusterSpec) -> bool:
    """Whether every address of `spec` is on this machine's loopback interface."""
    hosts = (split_address(spec.address(task))[0] for task in spec.tasks)
    return all(h in _LOOPBACK_HOSTS or h.startswith("127.") for h in hosts)


def enter_private_network() -> str | None:
    """Moves this process into a new network namespace that has only loopback.

    Tasks started afterwards share it: they reach each other on 127.0.0.1 and nothing
    outside can reach them (TensorFlow's gRPC servers listen on every interface).
    Unprivileged users get it through a user namespace where the kernel allows one.

    Returns:
        `None` on success, else why it could not be done.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(clone_newnet if uid == 0 else clone_newnet | clone_newuser) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:
        if uid != 0:  # Keep our own ids inside the user namespace.
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
                    f.write(text)
        siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
            fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
    except OSError as e:
        return f"loopback in the new namespace: {e}"
    return None


def _die_with_parent():
    """In the child: ask Linux to SIGKILL it when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Group:
    """The running tasks of one attempt, with their output pumps."""

    def __init__(self, config: LaunchConfig, spec: ClusterSpec, out_lock: threading.Lock):
        self.procs: dict[Task, subprocess.Popen] = {}
        self.tails: dict[Task, collections.deque] = {}
        self.pumps: list[threading.Thread] = []
        for slot, task in enumerate(config.tasks):
            proc = subprocess.Popen(
                config.command, env=task_env(config, spec, task, slot, dict(os.environ)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
            self.procs[task] = proc
            self.tails[task] = collections.deque(maxlen=TAIL_LINES)
            log = None
            if config.log_dir:
                log = open(os.path.join(config.log_dir, f"{task.type}_{task.index}.log"), "a",
                           encoding="utf-8")
            pump = threading.Thread(target=self._pump, args=(task, proc, log, out_lock), daemon=True)
            pump.start()
            self.pumps.append(pump)
            _say(f"started {task} (pid {proc.pid}) at {spec.address(task)}", out_lock)

    def _pump(self, task, proc, log, out_lock):
        prefix = f"[{task}] "
        for line in iter(proc.stdout.readline, b""):
            text = line.decode("utf-8", "replace").rstrip("\n")
            self.tails[task].append(text)
            with out_lock:
                sys.stdout.write(prefix + text + "\n")
                sys.stdout.flush()
            if log:
                log.write(text + "\n")
                log.flush()
        if log:
            log.close()

    def first_exit(self) -> TaskExit | None:
        """The first task found failed, else `None`; all done is `returncode` 0."""
        codes = {task: proc.poll() for task, proc in self.procs.items()}
        for task, code in codes.items():
            if code not in (None, 0):
                return TaskExit(task, code, [])
        if all(code == 0 for code in codes.values()):
            return TaskExit(next(iter(codes)), 0, [])
        return None

    def stop(self, grace_period: float) -> list[int]:
        """SIGTERM every live task's process group; SIGKILL what is left after the grace.

        Returns the tasks' exit codes."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        return [proc.returncode for proc in self.procs.values()]

    def finish(self, failure: TaskExit | None) -> TaskExit | None:
        for pump in self.pumps:
            pump.join(timeout=5)
        if failure is not None:
            failure.tail = list(self.tails[failure.task])
        return failure


def _signal_group(proc: subprocess.Popen, sig: int):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _say(message: str, out_lock: threading.Lock):
    with out_lock:
        sys.stdout.write(f"[launcher] {message}\n")
        sys.stdout.flush()


def run(config: LaunchConfig) -> LaunchResult:
    """Runs the job to success, or until restarts are exhausted or it is interrupted."""
    out_lock = threading.Lock()
    if config.log_dir:
        os.makedirs(config.log_dir, exist_ok=True)
    _protect_network(config, out_lock)
    received: list[int] = []  # Signals, recorded by the handler, acted on by the loop.

    def record(signum, frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    first_failure = None
    attempt = 0
    try:
        for attempt in range(1, config.max_restarts + 2):
            group = _Group(config, config.spec.with_free_ports(), out_lock)
            while (ended := group.first_exit()) is None and not received:
                time.sleep(0.1)
            if received:
                return _stop_on_signal(group, received[0], config, attempt, first_failure, out_lock)
            if ended.returncode == 0:
                group.finish(None)
                _say(f"every task succeeded (attempt {attempt})", out_lock)
                return LaunchResult(EXIT_OK, attempt, first_failure)
            group.stop(config.grace_period)
            failure = group.finish(ended)
            if ended.returncode == EXIT_PREEMPTED:
                _say(f"{failure.task} was preempted: every worker saved its state; start the "
                     "job again to resume", out_lock)
                return LaunchResult(EXIT_PREEMPTED, attempt, first_failure)
            first_failure = first_failure or failure
            if received:
                return _stop_on_signal(group, received[0], config, attempt, first_failure, out_lock)
            if ended.returncode in (EXIT_USAGE, EXIT_NONFINITE):  # It would fail again.
                _report(failure, attempt, 0, out_lock)
                return LaunchResult(EXIT_USAGE if ended.returncode == EXIT_USAGE else EXIT_FAILED,
                                    attempt, first_failure)
            _report(failure, attempt, config.max_restarts, out_lock)
        return LaunchResult(EXIT_FAILED, attempt, first_failure)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_signal(group, signum, config, attempt, first_failure, out_lock) -> LaunchResult:
    """SIGTERM (then SIGKILL) to every task; 75 if the job saved its state on SIGTERM."""
    _say(f"{signal.Signals(signum).name}: stopping every task (SIGTERM: a preemption, "
         "the main job saves first)", out_lock)
    codes = group.stop(config.grace_period)
    group.finish(None)
    if signum == signal.SIGTERM and EXIT_PREEMPTED in codes:
        _say("preempted: every worker saved its state; start the job again to resume", out_lock)
        return LaunchResult(EXIT_PREEMPTED, attempt, first_failure)
    return LaunchResult(EXIT_INTERRUPTED, attempt, first_failure)


def _protect_network(config: LaunchConfig, out_lock):
    """Makes a loopback-only cluster private, or says loudly that the job is exposed."""
    exposed = ("TensorFlow's gRPC servers listen on every interface of this machine, with no "
               "authentication: whoever reaches them can join or disrupt the job (SECURITY.md)")
    if not is_loopback_only(config.spec) or set(config.tasks) != set(config.spec.tasks):
        # Other launchers run the other tasks: they must share this host's network.
        _say(f"note: {exposed}; run it on a private network only", out_lock)
    elif not config.private:
        _say(f"WARNING: --no_private: {exposed}", out_lock)
    elif (why := enter_private_network()) is not None:
        _say(f"WARNING: could not make this local cluster private ({why}): {exposed}", out_lock)
    else:
        _say("local tasks run in a private network namespace: loopback only, "
             "unreachable from the network (and without network access)", out_lock)


def _report(failure: TaskExit, attempt: int, max_restarts: int, out_lock):
    restarts_left = max_restarts + 1 - attempt
    next_step = (f"restarting the group ({restarts_left} restart(s) left)" if restarts_left
                 else f"giving up after {attempt} attempt(s)")
    lines = "\n".join(f"[launcher]   {line}" for line in failure.tail[-10:])
    _say(f"attempt {attempt}: {failure.describe()} first; {next_step}. Its last lines:\n{lines}",
         out_lock)


# Command line -------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"distrib-tf-launch: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="distrib-tf-launch", description="Start the tasks of a cluster spec on this host.",
        epilog="Example: python -m distrib_tf.launch --cluster_spec=cluster_specs/"
               "local_2workers.json -- python -m distrib_tf.train")
    parser.add_argument("--cluster_spec", help="JSON spec file")
    parser.add_argument("--task", help="start only this task, TYPE:INDEX")
    parser.add_argument("--task_ordinal", type=int,
                        help="start only the spec's N-th task (chief, workers, evaluator order)")
    parser.add_argument("--slurm", action="store_true",
                        help="inside srun: the cluster and this task come from SLURM_*")
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument("--log_dir")
    parser.add_argument("--gpus_per_task", type=int, default=0)
    parser.add_argument("--collective_timeout", type=float)
    parser.add_argument("--grace_period", type=float, default=10.0)
    parser.add_argument("--no_private", action="store_true",
                        help="for a loopback-only spec, do not isolate the tasks in a private "
                             "network namespace (they are then reachable from the network)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser.parse_args(argv)


def _select_tasks(args: argparse.Namespace) -> tuple[ClusterSpec, tuple[Task, ...]]:
    """The cluster and the tasks this launcher starts, from --slurm, --task, or this host."""
    if args.slurm:
        if args.cluster_spec or args.task or args.task_ordinal is not None or args.max_restarts:
            raise ValueError("Invalid arguments with `--slurm`: the cluster and the task come "
                             "from SLURM_*, and restarts are Slurm's (`srun --kill-on-bad-exit=1`, "
                             "requeue). Expected no --cluster_spec, --task, --task_ordinal or "
                             "--max_restarts.")
        spec, task = load_slurm_cluster()
        return spec, (task,)
    if not args.cluster_spec:
        raise ValueError("Missing `--cluster_spec`. Expected a JSON spec file, such as "
                         "--cluster_spec=cluster_specs/local_2workers.json (or --slurm inside srun).")
    spec = ClusterSpec.from_file(args.cluster_spec)
    if args.task:
        return spec, (spec.check_task(parse_task(args.task)),)
    if args.task_ordinal is not None:
        if not 0 <= args.task_ordinal < len(spec.tasks):
            raise ValueError(f"Invalid value for `--task_ordinal`. Received: {args.task_ordinal}. "
                             f"Expected 0 to {len(spec.tasks) - 1} for the tasks of {spec.source}.")
        return spec, (spec.tasks[args.task_ordinal],)
    tasks = spec.local_tasks()
    if not tasks:
        raise ValueError(
            f"No task of {args.cluster_spec} lives on this host: none of its addresses "
            "is an address of this machine. Pass --task=TYPE:INDEX to name this host's task.")
    return spec, tasks


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validates the arguments; raises `ValueError` with one line on bad input."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("Missing command. Expected `-- COMMAND ...` after the options, "
                         "for example `-- python -m distrib_tf.train`.")
    if shutil.which(command[0]) is None:
        raise ValueError(f"Invalid value for `COMMAND`. Received: {command[0]!r}. "
                         "Expected a program on PATH or a path to an executable.")
    for name in ("max_restarts", "gpus_per_task"):
        if getattr(args, name) < 0:
            raise ValueError(f"Invalid value for `--{name}`. Received: {getattr(args, name)}. "
                             "Expected an integer >= 0.")
    if args.collective_timeout is not None and not args.collective_timeout > 0:
        raise ValueError(f"Invalid value for `--collective_timeout`. Received: "
                         f"{args.collective_timeout}. Expected a number of seconds > 0.")
    spec, tasks = _select_tasks(args)
    config = LaunchConfig(spec=spec, tasks=tasks, command=tuple(command),
                          max_restarts=args.max_restarts, log_dir=args.log_dir,
                          gpus_per_task=args.gpus_per_task,
                          collective_timeout=args.collective_timeout,
                          grace_period=args.grace_period, private=not args.no_private,
                          visible_gpus=tuple(placement.visible_gpus(os.environ)))
    for slot, task in enumerate(tasks):  # Placement errors now, before anything starts.
        task_env(config, spec.with_free_ports() if _has_free_ports(spec) else spec, task, slot, dict(os.environ))
    return config


def _has_free_ports(spec: ClusterSpec) -> bool:
    return any(split_address(spec.address(task))[1] == 0 for task in spec.tasks)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(args)
    except ValueError as e:  # ClusterSpecError included.
        print(f"distrib-tf-launch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    result = run(config)
    if result.exit_code == EXIT_FAILED:
        print(f"distrib-tf-launch: job failed after {result.attempts} attempt(s); first "
              f"failure: {result.first_failure.describe()}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
