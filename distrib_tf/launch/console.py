"""The launcher's console: the tasks' lines, one live status line, the events file.

This module imports no TensorFlow.
"""

import json
import threading
import time


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
