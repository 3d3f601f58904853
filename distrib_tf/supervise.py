"""Supervising the tasks of one host: start, prefix output, stop, restart, root cause.

The loop that `distrib_tf.launch` runs; its manual is that module's docstring. Signal
handlers only record the signal; the loop acts on it. This module imports no TensorFlow.
"""

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from distrib_tf import isolation
from distrib_tf import placement
from distrib_tf import slurm
from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import Task

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 75, 130
EXIT_NONFINITE = 65  # The main job's NaN/Inf stop: a restart would resume into it again.
TAIL_LINES = 20
# TensorFlow's error when its gRPC server cannot listen on its port (taken by another process).
GRPC_START_FAILURE = "Could not start gRPC server"
MAX_PORT_RETRIES = 3  # Fresh ports after a port race, not counted as restarts.


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


def task_placement(config: LaunchConfig, slot: int, base_env: dict[str, str]) -> dict[str, str]:
    """`LOCAL_RANK`, `LOCAL_WORLD_SIZE` and the GPUs of the `slot`-th local task. Pure.

    Raises:
        ValueError: the GPUs asked for do not fit or do not divide (`distrib_tf.placement`).
    """
    local_rank, local_tasks = slurm.local_rank(base_env) or (slot, len(config.tasks))
    return placement.placement_env(local_rank=local_rank, local_tasks=local_tasks,
                                   visible=list(config.visible_gpus), gpus_per_task=config.gpus_per_task,
                                   bound_per_task="SLURM_GPUS_PER_TASK" in base_env)


def task_env(config: LaunchConfig, spec: ClusterSpec, task: Task, slot: int,
             base_env: dict[str, str]) -> dict[str, str]:
    """The environment of `task`, the `slot`-th task started on this host. Pure."""
    env = {**base_env, "TF_CONFIG": spec.tf_config(task), "PYTHONUNBUFFERED": "1"}
    env.update(task_placement(config, slot, base_env))
    if config.collective_timeout:
        env["DISTRIB_TF_COLLECTIVE_TIMEOUT"] = str(config.collective_timeout)
    return env


class _Group:
    """The running tasks of one attempt, with their output pumps."""

    def __init__(self, config: LaunchConfig, spec: ClusterSpec, out_lock: threading.Lock):
        self.procs: dict[Task, subprocess.Popen] = {}
        self.tails: dict[Task, collections.deque] = {}
        self.pumps: list[threading.Thread] = []
        for slot, task in enumerate(config.tasks):
            proc = subprocess.Popen(
                isolation.dying_with_parent(config.command),
                env=task_env(config, spec, task, slot, dict(os.environ)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
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
    isolation.protect_network(config.spec, config.tasks, config.private,
                              lambda message: _say(message, out_lock))
    received: list[int] = []  # Signals, recorded by the handler, acted on by the loop.

    def record(signum, frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    first_failure = None
    attempt = restarts = port_retries = 0
    try:
        while True:
            attempt += 1
            spec = config.spec.with_free_ports()
            group = _Group(config, spec, out_lock)
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
            if received:
                return _stop_on_signal(group, received[0], config, attempt, first_failure or failure,
                                       out_lock)
            taken = _port_taken(config.spec, spec, failure)
            if taken and port_retries < MAX_PORT_RETRIES:
                port_retries += 1
                _say(f"{failure.task} could not listen on {taken}: another process took the port "
                     "after the launcher picked it; starting again with fresh ports (not counted "
                     "as a restart)", out_lock)
                continue
            first_failure = first_failure or failure
            if ended.returncode in (EXIT_USAGE, EXIT_NONFINITE):  # It would fail again.
                _report(failure, attempt, 0, out_lock)
                return LaunchResult(EXIT_USAGE if ended.returncode == EXIT_USAGE else EXIT_FAILED,
                                    attempt, first_failure)
            _report(failure, attempt, config.max_restarts - restarts, out_lock)
            if restarts == config.max_restarts:
                return LaunchResult(EXIT_FAILED, attempt, first_failure)
            restarts += 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _port_taken(requested: ClusterSpec, picked: ClusterSpec, failure: TaskExit) -> str | None:
    """The address of `failure.task` if its server could not start on a port picked for it."""
    if requested.address(failure.task).endswith(":0") and any(
            GRPC_START_FAILURE in line for line in failure.tail):
        return picked.address(failure.task)
    return None


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


def _report(failure: TaskExit, attempt: int, restarts_left: int, out_lock):
    next_step = (f"restarting the group ({restarts_left} restart(s) left)" if restarts_left
                 else f"giving up after {attempt} attempt(s)")
    lines = "\n".join(f"[launcher]   {line}" for line in failure.tail[-10:])
    _say(f"attempt {attempt}: {failure.describe()} first; {next_step}. Its last lines:\n{lines}",
         out_lock)
