"""Run distributed jobs from Jupyter: a handle with live progress, and plots of the results.

A notebook kernel cannot easily be one worker among several, so the job runs beside it:
`start_job()` starts the launcher (`distrib_tf.launch`) on a cluster spec and returns a
`Job` at once. `Job.wait()` shows live progress in the cell (a table refreshed in place,
one row per task, read from the job's event stream) and raises `JobFailed` with the
launcher's root cause if the job fails; `Job.stop()` stops every process of the job.
The plot helpers read a `model_dir` (its `summary.json`) and can save each figure as a
PNG.

Example:

    >>> job = start_job("local_2workers", model_dir="runs/nb",
    ...                 train_args=["--epochs=2"])
    >>> job.wait()      # Live progress; returns the summary.
    >>> plot_history("runs/nb", save="history.png")

This module imports no TensorFlow: the training runs in the job's processes.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from distrib_tf import events
from distrib_tf import launch
from distrib_tf.launch import console


class JobFailed(RuntimeError):
    """A job that did not succeed; its message is the launcher's root cause."""


class Job:
    """A job started by `start_job`: its status, output and progress.

    Progress, process ids, restarts and the root cause of a failure come from the job's
    event stream (`distrib_tf.events`, the launcher's `--events` file), not its text.

    Attributes:
        model_dir: where the job writes its summary, checkpoints and logs.
        command: the launcher command line.
        events_path: the job's events, one JSON object per line.
    """

    def __init__(self, command: list[str], model_dir: str, events_path: str, env: dict | None = None):
        self.command, self.model_dir, self.events_path = command, model_dir, events_path
        self._tails = collections.defaultdict(lambda: collections.deque(maxlen=200))
        self._follow = events.Follower(events_path)
        self._epochs: dict[str, tuple[int, int]] = {}
        self._pids: dict[str, int] = {}
        self._pidfds: dict[str, int] = {}  # Task: a pidfd of its process (`_hold`).
        self._restarts = 0
        self._root_cause = None
        self._status_line = ""
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, **(env or {})}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._stopped = False

    def __repr__(self):
        return f"Job(status={self.status!r}, model_dir={self.model_dir!r}, epochs={self._epochs})"

    def _read(self):
        """Keeps each task's last lines (for display only: nothing is parsed from them)."""
        for line in self._proc.stdout:
            text = line.rstrip("\n")
            task, _, rest = text.partition("] ")
            if text.startswith("[") and rest:
                self._tails[task[1:]].append(rest)
            else:
                self._tails["launcher"].append(text)
        self._proc.stdout.close()

    def _update(self):
        for event in self._follow():
            task, kind = event.get("task", "launcher"), event["event"]
            if kind == "started":
                self._pids[task] = event["pid"]
                self._hold(task, event["pid"])
                self._epochs.setdefault(task, (0, 0))
            elif kind == "train_begin":
                self._epochs[task] = (self._epochs.get(task, (0, 0))[0], event["epochs"])
            elif kind == "progress":
                self._status_line = console.status_line(event)
            elif kind == "epoch":
                self._epochs[task] = (event["epoch"], event["epochs"])
            elif kind == "task_failed" and event.get("restarts_left"):
                self._restarts += 1
            elif kind == "job_end":
                self._root_cause = event.get("root_cause")

    @property
    def status(self) -> str:
        """`running`, `succeeded`, `failed` or `stopped`."""
        code = self._proc.poll()
        if code is None:
            return "running"
        if self._stopped:
            return "stopped"
        return "succeeded" if code == 0 else "failed"

    @property
    def restarts(self) -> int:
        self._update()
        return self._restarts

    @property
    def pids(self) -> dict[str, int]:
        """The process id of each task of the current attempt."""
        self._update()
        return dict(self._pids)

    @property
    def root_cause(self) -> str | None:
        """Why the job failed, in one line: the launcher's account, else its last line."""
        if self.status != "failed":
            return None
        self._reader.join(timeout=5)
        self._update()
        return self._root_cause or (self.tail("launcher", 1) or ["no output"])[0]

    def tail(self, task: str = "worker:0", lines: int = 10) -> list[str]:
        """The last `lines` lines of a task's output (`launcher` for the launcher's own)."""
        return list(self._tails[task])[-lines:]

    def progress(self) -> list[dict]:
        """One row per task: epochs done, of how many, and its last line."""
        self._update()
        tasks = sorted(self._epochs)
        return [{"task": t, "epochs": "{}/{}".format(*self._epochs.get(t, (0, 0))),
                 "last line": (self._tails[t][-1] if self._tails[t] else "")[:100]} for t in tasks]

    def wait_for_epoch(self, epoch: int, task: str = "worker:0", timeout: float = 600) -> bool:
        """Waits until `task` has finished `epoch` epochs (or the job ended); says which."""
        deadline = time.monotonic() + timeout
        while self.status == "running" and time.monotonic() < deadline:
            self._update()
            if self._epochs.get(task, (0, 0))[0] >= epoch:
                return True
            time.sleep(0.2)
        self._update()
        return self._epochs.get(task, (0, 0))[0] >= epoch

    def _hold(self, task: str, pid: int):
        """Holds the task's process by a pidfd: a signal then reaches that process or none,
        never another that reused its id. Only a child of this job's launcher is held."""
        old = self._pidfds.pop(task, None)
        if old is not None:
            os.close(old)
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return  # Gone already.
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            parent = None
        if parent == self._proc.pid:
            self._pidfds[task] = fd
        else:  # The id was reused before we looked: not our task.
            os.close(fd)

    def kill_task(self, task: str, sig: int = signal.SIGKILL):
        """Sends `sig` to one task, as a failing machine would (the launcher restarts it).

        Raises:
            ProcessLookupError: the task has already ended.
        """
        self._update()
        fd = self._pidfds.get(task)
        if fd is None:
            raise ProcessLookupError(f"{task} is not running")
        signal.pidfd_send_signal(fd, sig)

    def wait(self, timeout: float | None = None, *, progress: bool = True, every: float = 1.0) -> dict | None:
        """Waits for the end; shows a table refreshed in place. Returns the summary, if any.

        Raises:
            JobFailed: the job failed; the message is its root cause.
        """
        display = _Display() if progress else None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status == "running" and (deadline is None or time.monotonic() < deadline):
            if display:
                display.update(self._render())
            time.sleep(every)
        if self.status != "running":
            self._reader.join(timeout=5)  # The last lines, then the pipe closes.
        if display:
            display.update(self._render())
        if self.status == "failed":
            raise JobFailed(self.root_cause)
        return self.summary()

    def stop(self, grace: float = 15.0):
        """Stops the job and every task (the launcher forwards it), leaving no process behind."""
        if self._proc.poll() is None:
            self._stopped = True
            os.killpg(self._proc.pid, signal.SIGINT)
            try:
                self._proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        # The tasks die with the launcher (`distrib_tf.launch._task_init`): no process id of
        # theirs is signalled here, since a finished task's id may belong to another process.
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._reader.join(timeout=5)

    def summary(self) -> dict | None:
        path = os.path.join(self.model_dir, "summary.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def _render(self) -> str:
        rows = self.progress()
        width = max([len(r["task"]) for r in rows] + [4])
        lines = [f"job {self.status}; restarts {self._restarts}; model_dir {self.model_dir}",
                 *([self._status_line] if self._status_line else [])]
        for r in rows:
            done, total = (int(x) for x in r["epochs"].split("/"))
            bar = "#" * round(20 * done / total) if total else ""
            lines.append(f"{r['task']:<{width}} [{bar:<20}] {r['epochs']:>5}  {r['last line']}")
        return "\n".join(lines)


class _Display:
    """Refreshes one output area in Jupyter; prints changed text elsewhere."""

    def __init__(self):
        try:
            from IPython import get_ipython  # pylint: disable=import-outside-toplevel
            from IPython.display import Pretty  # pylint: disable=import-outside-toplevel
            from IPython.display import display  # pylint: disable=import-outside-toplevel
            self._pretty = Pretty
            self._handle = display(Pretty(""), display_id=True) if get_ipython() else None
        except ImportError:
            self._handle = None
        self._last = None

    def update(self, text: str):
        if text == self._last:
            return
        self._last = text
        if self._handle is not None:
            self._handle.update(self._pretty(text))
        else:
            print(text, flush=True)


def start_job(cluster_spec: str, *, model_dir: str, train_args: list[str] | None = None,
              command: list[str] | None = None, max_restarts: int = 1, log_dir: str | None = None) -> Job:
    """Starts the main job (or `command`) on every local task of `cluster_spec`.

    Args:
        cluster_spec: a spec file, or a shipped spec's name such as `local_2workers`.
        model_dir: passed to the main job as `--model_dir`.
        train_args: more flags for `python -m distrib_tf.train`.
        command: another command to run instead of the main job.
        max_restarts: restarts of the group after a failure.
        log_dir: also write each task's output there.

    Returns:
        The `Job`, at once.
    """
    command = command or launch.main_job_command(model_dir, train_args or [])
    events_path = os.path.join(tempfile.mkdtemp(prefix="distrib_tf_job_"), "events.jsonl")
    return Job(launch.command_line(cluster_spec, command, max_restarts=max_restarts, grace_period=5,
                                   log_dir=log_dir, events=events_path), model_dir, events_path)


# Plots --------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError("Plots need matplotlib: pip install 'distrib_tf[notebook]'") from e
    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    return plt


def _epochs(run) -> list[dict]:
    """Per-epoch rows from a model_dir, a summary dict, or a Keras History."""
    if isinstance(run, (str, os.PathLike)):
        with open(os.path.join(run, "summary.json"), encoding="utf-8") as f:
            run = json.load(f)
    if hasattr(run, "history"):
        return [{"epoch": e + 1, **{k: v[i] for k, v in run.history.items()}} for i, e in enumerate(run.epoch)]
    return run["epochs"]


def _finish(fig, save):
    fig.tight_layout()
    if save:
        fig.savefig(save, dpi=120)
    return fig


def plot_history(run, *, save: str | None = None):
    """Loss and accuracy per epoch (train and validation) of one run."""
    plt = _pyplot()
    rows = _epochs(run)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        for key, style in ((metric, "-o"), (f"val_{metric}", "--s")):
            if key in rows[0]:
                ax.plot([r["epoch"] for r in rows], [r[key] for r in rows], style, label=key)
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    return _finish(fig, save)


def plot_throughput(run, *, save: str | None = None):
    """Training examples per second of every epoch of one run."""
    plt = _pyplot()
    rows = [r for r in _epochs(run) if "examples_per_second" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([r["epoch"] for r in rows], [r["examples_per_second"] for r in rows])
    ax.set_xlabel("epoch")
    ax.set_ylabel("examples / second")
    return _finish(fig, save)


def compare_runs(runs: dict, *, metric: str = "val_accuracy", save: str | None = None):
    """One metric per epoch for several runs: `{label: model_dir or summary}`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, run in runs.items():
        rows = _epochs(run)
        ax.plot([r["epoch"] for r in rows], [r[metric] for r in rows], "-o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.legend()
    return _finish(fig, save)


def plot_scaling(runs: list[tuple[str, int, float]], *, save: str | None = None):
    """Examples per second and scaling efficiency of `[(label, replicas, examples_per_second)]`.

    Efficiency is a run's rate over `replicas` times the one-replica rate (the first run
    with one replica).
    """
    plt = _pyplot()
    single = next(rate for _, replicas, rate in runs if replicas == 1)
    labels = [label for label, _, _ in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.bar(labels, [rate for _, _, rate in runs])
    left.set_ylabel("examples / second")
    right.bar(labels, [rate / (replicas * single) for _, replicas, rate in runs])
    right.axhline(1.0, linestyle=":", color="gray")
    right.set_ylabel("scaling efficiency")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    return _finish(fig, save)
