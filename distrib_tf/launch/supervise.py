"""Supervising the tasks of one host: start, prefix output, stop, restart, root cause.

The loop that `distrib_tf.launch` runs; its manual is that module's docstring. Signal
handlers only record the signal; the loop acts on it. This module imports no TensorFlow.
"""

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time

from distrib_tf import events
from distrib_tf import exit_codes
from distrib_tf import lifeline
from distrib_tf import trial
from distrib_tf.cluster import VERBOSE_ENV
from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import Task
from distrib_tf.deploy import slurm
from distrib_tf.launch import console as console_lib
from distrib_tf.launch import isolation
from distrib_tf.launch import placement

TAIL_LINES = 20
# TensorFlow's error when its gRPC server cannot listen on its port (taken by another process).
GRPC_START_FAILURE = "Could not start gRPC server"
MAX_PORT_RETRIES = 3  # Fresh ports after a port race, not counted as restarts.
# Unless --verbose: TensorFlow's C++ logs at errors only. TensorFlow writes a few INFO
# lines before its logging reads the level (`port.cc`, `cudart_stub.cc`), absl then says
# so, and a machine without a GPU driver logs the error `failed call to cuInit` though
# nothing failed: the launcher drops those lines itself. So are TensorFlow 2.18's and 2.19's
# three errors at import, one per CUDA library whose factory XLA registers twice (on any
# machine, GPU or not; 2.20 and 2.21 no longer log them): the first in TSL's own format.
QUIET_LOG_LEVEL = "2"
_GLOG_INFO_OR_WARNING = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")
_QUIET_DROPPED = ("] failed call to cuInit: ",
                  "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
_CUDA_FACTORY_REGISTERED_TWICE = re.compile(
    r"^(?:E\d{4} \d\d:\d\d:\d+\.\d+ +\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: E )\S+:\d+\] "
    r"Unable to register (cuFFT|cuDNN|cuBLAS) factory: Attempting to register factory for plugin \1 when one "
    r"has already been registered$")


def is_quieted(line: str) -> bool:
    """Whether the launcher drops `line` of a task's output unless --verbose. Pure."""
    return (bool(_GLOG_INFO_OR_WARNING.match(line) or _CUDA_FACTORY_REGISTERED_TWICE.match(line))
            or any(text in line for text in _QUIET_DROPPED))


GRACE_ENV = "DISTRIB_TF_GRACE_SECONDS"  # Seconds from SIGTERM to SIGKILL, for the tasks.
# A scheduler's SIGTERM, and SIGHUP (the ssh session or terminal gone): the tasks save, exit 75.
SAVING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to start and how; validated by `config_from_args`."""

    spec: ClusterSpec
    tasks: tuple[Task, ...]
    command: tuple[str, ...]
    max_restarts: int = 0
    log_dir: str | None = None
    gpus_per_task: int = 0
    local_rank_offset: int = 0  # This launcher's first task's local rank among all the host's tasks.
    local_world_size: int = 0  # The tasks of every launcher on this host (0: this launcher's).
    collective_timeout: float | None = None
    grace_period: float = 10.0
    private: bool = True
    visible_gpus: tuple[str, ...] = ()  # What the launcher was given, to share out.
    cpus: tuple[int, ...] = ()  # The CPUs the launcher may use, to share out (empty: leave alone).
    events_path: str | None = None  # Append every event there (`distrib_tf.events`).
    verbose: bool = False  # TensorFlow's C++ logs at its own level, nothing dropped.


@dataclasses.dataclass
class TaskExit:
    task: Task
    returncode: int
    tail: list[str]
    error: str = ""  # The task's own one-line account, from its `failed` event.

    def describe(self) -> str:
        if self.returncode < 0:
            how = f"was killed by {signal.Signals(-self.returncode).name}"
        else:
            how = f"exited with code {self.returncode}"
        return f"{self.task} {how}"

    def root_cause(self) -> str:
        """One line: which task, how it ended, and its error (else its last line)."""
        last = self.error or next((line for line in reversed(self.tail) if line.strip()), "")
        return f"{self.describe()}: {last.strip()}" if last else self.describe()


@dataclasses.dataclass
class LaunchResult:
    """How a launch ended: the exit code and, on failure, the first task that failed."""

    exit_code: int
    attempts: int
    first_failure: TaskExit | None = None

    def is_failed(self) -> bool:
        return self.exit_code != exit_codes.OK


def task_placement(config: LaunchConfig, slot: int, base_env: dict[str, str]) -> dict[str, str]:
    """`LOCAL_RANK`, `LOCAL_WORLD_SIZE`, the GPUs, CPUs and threads of the `slot`-th local task. Pure.

    Raises:
        ValueError: the GPUs asked for do not fit or do not divide (`distrib_tf.launch.placement`).
    """
    under_slurm = slurm.local_rank(base_env)
    local_rank, local_tasks = under_slurm or (
        config.local_rank_offset + slot,
        max(config.local_world_size, config.local_rank_offset + len(config.tasks)))
    return placement.placement_env(local_rank=local_rank, local_tasks=local_tasks,
                                   visible=list(config.visible_gpus), gpus_per_task=config.gpus_per_task,
                                   bound_per_task="SLURM_GPUS_PER_TASK" in base_env,
                                   # Slurm binds its tasks itself (`--cpu-bind`): its share stands.
                                   cpus=[] if under_slurm else list(config.cpus), environ=base_env)


def task_env(config: LaunchConfig, spec: ClusterSpec, task: Task, slot: int,
             base_env: dict[str, str]) -> dict[str, str]:
    """The environment of `task`, the `slot`-th task started on this host. Pure."""
    env = {**base_env, "TF_CONFIG": spec.tf_config(task), "PYTHONUNBUFFERED": "1"}
    env.pop(lifeline.PARENT_ENV, None)  # The launcher's parent, not the task's.
    env.update(task_placement(config, slot, base_env))
    if config.collective_timeout:
        env["DISTRIB_TF_COLLECTIVE_TIMEOUT"] = str(config.collective_timeout)
    env[GRACE_ENV] = str(config.grace_period)  # The preemption handshake sizes its waits to it.
    if not config.verbose:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_LOG_LEVEL)
    else:
        env[VERBOSE_ENV] = "1"  # Every worker prints its lines (`distrib_tf.cluster.speaks`).
    return env


class _Group:
    """The running tasks of one attempt, with their output and event pumps."""

    def __init__(self, config: LaunchConfig, spec: ClusterSpec, console: console_lib.Sink, attempt: int):
        self.procs: dict[Task, subprocess.Popen] = {}
        self.tails: dict[Task, collections.deque] = {}
        self.pumps: list[threading.Thread] = []
        self.console, self.quiet = console, not config.verbose
        self.errors: dict[Task, str] = {}  # From each task's `failed` event.
        for slot, task in enumerate(config.tasks):
            read_end, write_end = os.pipe()  # The task's events (`distrib_tf.events`).
            proc = _start(config.command, env={**task_env(config, spec, task, slot, dict(os.environ)),
                                               events.FD_ENV: events.pipe_name(write_end)}, events_fd=write_end)
            os.close(write_end)
            self.procs[task] = proc
            self.tails[task] = collections.deque(maxlen=TAIL_LINES)
            log = None
            if config.log_dir:
                log = open(os.path.join(config.log_dir, f"{task.type}_{task.index}.log"), "a",
                           encoding="utf-8")
            pump = threading.Thread(target=self._pump, args=(task, proc, log, console), daemon=True)
            pump.start()
            listener = threading.Thread(target=self._listen, args=(task, read_end), daemon=True)
            listener.start()
            self.pumps += [pump, listener]
            _say(f"started {task} (pid {proc.pid}) at {spec.address(task)}", console)
            console.event(str(task), {"event": "started", "pid": proc.pid, "attempt": attempt})

    def _pump(self, task, proc, log, console):
        prefix = f"[{task}] "
        for line in iter(proc.stdout.readline, b""):
            text = line.decode("utf-8", "replace").rstrip("\n")
            self.tails[task].append(text)
            if not (self.quiet and is_quieted(text)):
                console.line(prefix + text)
            if log:
                log.write(text + "\n")
                log.flush()
        if log:
            log.close()

    def _listen(self, task, read_end):
        with open(read_end, encoding="utf-8", errors="replace") as pipe:
            for line in pipe:
                if (event := events.parse(line)) is not None:
                    if event["event"] == "failed":
                        self.errors[task] = str(event.get("error", ""))
                    self.console.event(str(task), event)

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
            failure.error = self.errors.get(failure.task, "")
        return failure


def _start(command, *, env: dict, events_fd: int):
    """The one place tasks start: forked from a pre-imported interpreter where `env` names a
    fork server that serves `command` (`distrib_tf.launch.forkserver`), else a new process.
    Either way the task dies with the launcher, in a session of its own."""
    from distrib_tf.launch import forkserver  # pylint: disable=import-outside-toplevel  (`-m` runs it too)

    if forkserver.serves(command, env):
        try:
            with open(os.devnull, "rb") as devnull:
                return forkserver.spawn(command, env=env, stdin=devnull.fileno(), stdout=-1, stderr=-2,
                                        pass_fds=(events_fd,))
        except OSError:  # The server went away since it answered: a new process, as without one.
            pass
    return subprocess.Popen(
        isolation.dying_with_parent(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(events_fd,))


def _signal_group(proc: subprocess.Popen, sig: int):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _say(message: str, console: console_lib.Sink):
    console.line(f"[launcher] {message}")


def run(config: LaunchConfig) -> LaunchResult:
    """Runs the job to success, or until restarts are exhausted or it is interrupted."""
    console = console_lib.Sink(sys.stdout, path=config.events_path)
    try:
        result = _run(config, console)
        failure = result.first_failure
        console.event("launcher", {"event": "job_end", "exit_code": result.exit_code,
                                   "attempts": result.attempts, "tasks": [str(t) for t in config.tasks],
                                   "root_cause": failure.root_cause() if failure else None})
        return result
    finally:
        console.close()


def _run(config: LaunchConfig, console: console_lib.Sink) -> LaunchResult:
    if config.log_dir:
        os.makedirs(config.log_dir, exist_ok=True)
    isolated = isolation.protect_network(config.spec, config.tasks, config.private,
                                         lambda message: _say(message, console))
    received: list[int] = []  # Signals, recorded by the handler, acted on by the loop.

    def record(signum, frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, *SAVING_SIGNALS)}
    first_failure = None
    attempt = restarts = port_retries = 0
    try:
        while True:
            attempt += 1
            spec = config.spec.with_free_ports()
            group = _Group(config, spec, console, attempt)
            while (ended := group.first_exit()) is None and not received:
                time.sleep(0.1)
            if received:
                return _stop_on_signal(group, received[0], config, attempt, first_failure, console)
            if ended.returncode == 0:
                group.finish(None)
                _say(f"every task succeeded (attempt {attempt})", console)
                return LaunchResult(exit_codes.OK, attempt, first_failure)
            codes = group.stop(config.grace_period)
            failure = group.finish(ended)
            if ended.returncode == exit_codes.PREEMPTED:  # A task's own SIGTERM (its pid, a pod's, a lifeline).
                if all(code in (exit_codes.OK, exit_codes.PREEMPTED) for code in codes):
                    _say(f"{failure.task} was preempted: every worker saved its state; start the "
                         "job again to resume", console)
                    return LaunchResult(exit_codes.PREEMPTED, attempt, first_failure)
                each = "; ".join(TaskExit(task, code, []).describe() for task, code in zip(group.procs, codes))
                _say(f"{failure.task} was preempted, but not every task saved its state ({each}): exit code "
                     f"{exit_codes.INTERRUPTED}", console)
                return LaunchResult(exit_codes.INTERRUPTED, attempt, first_failure)
            if received:
                return _stop_on_signal(group, received[0], config, attempt, first_failure or failure,
                                       console)
            taken = _port_taken(config.spec, spec, failure)
            if taken and port_retries < MAX_PORT_RETRIES:
                port_retries += 1
                _say(f"{failure.task} could not listen on {taken}: another process took the port "
                     "after the launcher picked it; starting again with fresh ports (not counted "
                     "as a restart)", console)
                continue
            first_failure = first_failure or failure
            if ended.returncode == exit_codes.PRUNED and trial.current() is not None and all(
                    code in (exit_codes.OK, exit_codes.PRUNED) for code in codes):  # Outside a sweep, 3 is a failure.
                _say(f"{failure.task} was pruned by the sweep: every worker saved its state", console)
                return LaunchResult(exit_codes.PRUNED, attempt, first_failure)
            if ended.returncode in (exit_codes.USAGE, exit_codes.NONFINITE):  # It would fail again.
                _report(failure, attempt, 0, console, isolated)
                # Its own code: the Kubernetes exports' rules fail the job on 2 and 65.
                return LaunchResult(ended.returncode, attempt, first_failure)
            _report(failure, attempt, config.max_restarts - restarts, console, isolated)
            if restarts == config.max_restarts:
                return LaunchResult(exit_codes.FAILED, attempt, first_failure)
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


def _stop_on_signal(group, signum, config, attempt, first_failure, console) -> LaunchResult:
    """SIGTERM (then SIGKILL) to every task; 75 if the job saved its state on SIGTERM."""
    _say(f"{signal.Signals(signum).name}: stopping every task (SIGTERM: a preemption, "
         "the main job saves first)", console)
    codes = group.stop(config.grace_period)
    group.finish(None)
    if all(code == exit_codes.OK for code in codes):  # They had finished: nothing to resume.
        _say(f"every task succeeded (attempt {attempt})", console)
        return LaunchResult(exit_codes.OK, attempt, first_failure)
    # A task SIGTERM killed by the signal's default had no run (a run's handler saves and exits
    # 75): still starting its interpreter and imports, it trained nothing and holds nothing to
    # save, and its peers could train nothing without it. Beside a peer that saved (so the job
    # is a run's), the job lost nothing. Alone, it may be a script without a run: 130.
    unstarted = [task for task, code in zip(group.procs, codes) if code == -signal.SIGTERM]
    saved = exit_codes.PREEMPTED in codes and all(
        code in (exit_codes.OK, exit_codes.PREEMPTED, -signal.SIGTERM) for code in codes)
    if signum in SAVING_SIGNALS and saved:
        before = (f" ({', '.join(map(str, unstarted))}: stopped before its run started, nothing to save)"
                  if unstarted else "")
        _say(f"preempted: every worker saved its state{before}; start the job again to resume", console)
        return LaunchResult(exit_codes.PREEMPTED, attempt, first_failure)
    ended = "; ".join(TaskExit(task, code, []).describe() for task, code in zip(group.procs, codes))
    _say(f"{signal.Signals(signum).name}: not every task saved its state ({ended}): exit code "
         f"{exit_codes.INTERRUPTED}", console)
    return LaunchResult(exit_codes.INTERRUPTED, attempt, first_failure)


def _report(failure: TaskExit, attempt: int, restarts_left: int, console, isolated: bool = False):
    next_step = (f"restarting the group ({restarts_left} restart(s) left)" if restarts_left
                 else f"giving up after {attempt} attempt(s)")
    console.event(str(failure.task), {"event": "task_failed", "attempt": attempt,
                                      "how": failure.describe(), "root_cause": failure.root_cause(),
                                      "lines": failure.tail[-10:], "restarts_left": restarts_left})
    lines = "\n".join(f"[launcher]   {line}" for line in failure.tail[-10:])
    _say(f"attempt {attempt}: {failure.describe()} first; {next_step}. Its last lines:\n{lines}",
         console)
    if isolated and (hint := isolation.no_network_hint([*failure.tail, failure.error])):
        _say(f"hint: {hint}", console)
