"""The event stream: JSON lines that every task writes and the launcher, notebooks and sweeps read.

A task started by the launcher finds a pipe in `DISTRIB_TF_EVENTS_FD` (`FD:INODE`: its
file descriptor, and the pipe's inode so that a process that inherited the variable but
not the pipe, such as a child a wrapper script started, writes nothing) and writes one
JSON object per line to it with `emit()`; elsewhere `emit()` does nothing. The
launcher reads every local task's pipe, shows the job's status line from it
(`distrib_tf.launch.console`), and with `--events=FILE` appends every event to FILE with
the task that sent it; its own events (a task started, failed, the job ended) go there too, as task `launcher`.
Every event has `event`, `task` and `time` (Unix seconds). The events:

- `started` (launcher): `pid`, `attempt`, for each task it starts;
- `train_begin` (task): `epochs`, `steps`, `workers`;
- `progress` (task, at most once a second): `epoch`, `epochs`, `step`, `steps`,
  `examples_per_second`, `eta_seconds`, `worker_step_seconds` (`distrib_tf.keras.progress`);
- `epoch` (task): `epoch`, `epochs`, `fit` (which `fit` of the script, from 1), `metrics`;
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
