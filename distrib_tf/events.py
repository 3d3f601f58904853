"""The event stream: JSON lines that every task writes and the launcher, notebooks and sweeps read.

A task started by the launcher finds a pipe in `DISTRIB_TF_EVENTS_FD` (`FD:INODE`: its
file descriptor, and the pipe's inode so that a process that inherited the variable but
not the pipe, such as a child a wrapper script started, writes nothing) and writes one
JSON object per line to it with `emit()`; elsewhere `emit()` does nothing. The
launcher reads every local task's pipe, shows the job's status line from it, and with
`--events=FILE` appends every event to FILE with the task that sent it;
its own events (a task started, failed, the job ended) go there too, as task `launcher`.
Every event has `event`, `task` and `time` (Unix seconds). The events:

- `started` (launcher): `pid`, `attempt`, for each task it starts;
- `train_begin` (task): `epochs`, `steps`, `workers`;
- `progress` (task, at most once a second): `epoch`, `epochs`, `step`, `steps`,
  `examples_per_second`, `eta_seconds`, `worker_step_seconds` (`distrib_tf.progress`);
- `epoch` (task): `epoch`, `epochs`, `metrics`;
- `straggler` (task): `straggler`, `ratio`, `step_seconds`, `others_seconds`;
- `finished` (task): `final` (metrics), `summary` (its path, the chief only);
- `failed` (task): `error`, one line;
- `task_failed` (launcher): `how`, `root_cause`, `lines` (its last), `restarts_left`;
- `job_end` (launcher): `exit_code`, `attempts`, `root_cause`.

Reading a file another process is writing: `follow(path)` yields whole lines only.
This module imports no TensorFlow.
"""

import json
import os
import stat
import threading
import time

FD_ENV = "DISTRIB_TF_EVENTS_FD"
_lock = threading.Lock()
_pipe: list[int | None] = []  # Once looked up: the pipe's descriptor, or None.


def pipe_name(fd: int) -> str:
    """The value of `DISTRIB_TF_EVENTS_FD` for the write end `fd` of a pipe."""
    return f"{fd}:{os.fstat(fd).st_ino}"


def _find_pipe() -> int | None:
    fd, _, inode = os.environ.get(FD_ENV, "").partition(":")
    try:
        found = os.fstat(int(fd))
    except (OSError, ValueError):
        return None
    return int(fd) if stat.S_ISFIFO(found.st_mode) and str(found.st_ino) == inode else None


def enabled() -> bool:
    with _lock:
        if not _pipe:
            _pipe.append(_find_pipe())
        return _pipe[0] is not None


def emit(event: str, **fields) -> None:
    """Writes one event to the launcher's pipe, if there is one; never raises for it.

    The descriptor is the launcher's, written with `os.write` and never closed here.
    """
    if not enabled():
        return
    data = (json.dumps({"event": event, "time": time.time(), **fields}, default=float) + "\n").encode()
    with _lock:
        try:
            while data:
                data = data[os.write(_pipe[0], data):]
        except OSError:  # The launcher is gone.
            _pipe[0] = None


def parse(line: str) -> dict | None:
    """One event from one line, or `None` for a line that is not one."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


class Follower:
    """Reads the events appended to a file so far, whole lines only, each time it is called."""

    def __init__(self, path: str):
        self.path, self._offset, self._partial = path, 0, ""

    def __call__(self) -> list[dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        return [event for line in lines if (event := parse(line))]


def read(path: str) -> list[dict]:
    """Every whole event in a file."""
    return Follower(path)()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds + 0.5), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


def status_line(progress: dict) -> str:
    """The job's one status line from a `progress` event. Pure.

    Example:

        >>> status_line({"epoch": 2, "epochs": 3, "step": 64, "steps": 128,
        ...              "examples_per_second": 812.4, "eta_seconds": 95,
        ...              "worker_step_seconds": {"worker:0": 0.071, "worker:1": 0.094}})
        'epoch 2/3  step 64/128  812 examples/s  ETA 1:35  slowest worker:1 94 ms/step'
    """
    parts = [f"epoch {progress['epoch']}/{progress['epochs']}",
             f"step {progress['step']}/{progress['steps']}"]
    if progress.get("examples_per_second"):
        parts.append(f"{progress['examples_per_second']:.0f} examples/s")
    if progress.get("eta_seconds") is not None:
        parts.append(f"ETA {_clock(progress['eta_seconds'])}")
    times = progress.get("worker_step_seconds") or {}
    if times:
        slowest = max(times, key=times.get)
        parts.append(f"slowest {slowest} {1000 * times[slowest]:.0f} ms/step")
    return "  ".join(parts)


class Sink:
    """The launcher's console: task lines, the job's status line, and the events file.

    Events from every local task update the status line and, with `path`, are appended to
    that file with the task that sent them. On a terminal the status line stays under the
    tasks' output, redrawn in place; elsewhere it is printed as a plain line every
    `plain_every` seconds (0: never). The line shows the first task that reports progress.
    """

    def __init__(self, out, *, path: str | None = None, plain_every: float = 30.0):
        self._out, self._tty, self._plain_every = out, out.isatty(), plain_every
        self._file = open(path, "a", encoding="utf-8") if path else None  # pylint: disable=consider-using-with
        self._status, self._lead, self._shown = "", None, time.monotonic()
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """Prints one line of output, above the status line on a terminal."""
        with self._lock:
            if self._tty and self._status:
                self._out.write(f"\r\x1b[K{text}\n{self._status}")
            else:
                self._out.write(text + "\n")
            self._out.flush()

    def event(self, task: str, event: dict) -> None:
        event = {**event, "task": task, "time": event.get("time", time.time())}
        with self._lock:
            if self._file:
                self._file.write(json.dumps(event, default=str) + "\n")
                self._file.flush()
        if event["event"] != "progress" or (self._lead or task) != task:
            return
        self._lead, self._status = task, status_line(event)
        if self._tty:
            with self._lock:
                self._out.write(f"\r\x1b[K{self._status}")
                self._out.flush()
        elif self._plain_every and time.monotonic() - self._shown >= self._plain_every:
            self._shown = time.monotonic()
            self.line(f"[launcher] status: {self._status}")

    def close(self) -> None:
        with self._lock:
            if self._tty and self._status:
                self._out.write("\n")
                self._status = ""
            if self._file:
                self._file.close()
                self._file = None
