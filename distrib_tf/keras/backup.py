"""The files of the backups that every worker keeps on its own disk: their format, their
writer in the background and what is kept.

Hosts need not share a disk. Every worker (the chief too) writes its own backups into
its own directory, `model_dir/backup/<task>/` on its own host:

    step-000000120.state        every variable of the model and its optimizer after global
                                step 120, their bytes one after the other
    step-000000120.json         {"run": ..., "step": 120, "epoch": 3, "task": "worker:1",
                                 "variables": [[path, dtype, shape], ...], "history": [...]}

The state holds what `save_weights` leaves out too: every `SeedGenerator`'s state (each
`Dropout`, random augmentation or noise layer), so that a resumed run draws the masks the
uninterrupted one would; the metadata holds the logs of every epoch finished (the user's
History, whole across restarts). A step waits only while the state is taken (`snapshot`,
no copy); the files are written in the background (`WRITER`). Backups of earlier
versions (Keras's `.weights.h5`, the seeds in the metadata) are still read.

The `.json` file is written last and atomically: a backup without it does not exist, so
a process killed while writing leaves the previous backup whole. Both files and the
directory are synced to the disk before the metadata counts (a machine that crashes
cannot leave metadata pointing at weights still in its page cache), and the metadata
holds the state's size and SHA-256: a backup whose state does not match is not listed,
so every worker advertises only backups that will load. The last `keep` backups are
kept. Saving runs no collectives, so each worker saves alone.

Which backup a start resumes, and how a worker without it receives it, is
`distrib_tf.keras.resume`'s; when a backup is taken during training,
`distrib_tf.keras.worker_backup`'s: this module reads and writes one worker's files.

What is kept where: each task writes only its own directory, keeping its last 2 backups.
The backups of tasks a layout no longer has are read, never written; a worker deletes
those beside its own once it has backed up a newer step (`retire_gone`), and a
`fresh_start` deletes every backup of the run it can see (`clear_run`). At a clean end
each task keeps its last backup, marked finished (`finish`).

Example:

    >>> [b["step"] for b in list_backups("/tmp/run/backup/worker-0")]  # Written by `WorkerBackup`.
    [100, 150]
"""

import atexit
import glob
import hashlib
import json
import os
import queue
import re
import tempfile
import threading
import time

import numpy as np

_NAME = re.compile(r"step-(\d+)\.json$")


def task_dirname(task: str) -> str:
    """`worker:1` -> `worker-1`: a directory name for a task's own backups."""
    return task.replace(":", "-")


def list_backups(directory: str) -> list[dict]:
    """The complete, intact backups in `directory`, oldest first (their metadata)."""
    found = [m for m in metadata_of(directory) if _intact(data_path(directory, m), m)]
    return sorted(found, key=lambda m: m["step"])


def _intact(weights: str, meta: dict) -> bool:
    """The weights exist and, where the metadata says (all but older backups), match it."""
    try:
        if "bytes" in meta and os.path.getsize(weights) != meta["bytes"]:
            return False
        return "sha256" not in meta or _sha256(weights) == meta["sha256"]
    except OSError:
        return False


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_private_dirs(path: str, *, tighten: bool = False) -> None:
    """Creates `path` and each missing folder above it readable by their owner alone (0700:
    `os.makedirs(mode=...)` applies the mode to the last one only); `tighten`: an existing
    `path` is made 0700 too (the run's own `model_dir`)."""
    missing, folder = [], os.path.abspath(path)
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for each in reversed(missing):
        try:
            os.mkdir(each, 0o700)
        except FileExistsError:  # Another worker on a shared disk made it first.
            pass
        os.chmod(each, 0o700)  # Not the umask's.
    if tighten and not missing:
        os.chmod(path, 0o700)


def fsync(path: str) -> None:
    """Flushes a file, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _weights_path(directory: str, step: int) -> str:
    """An older backup's weights, Keras's `.weights.h5` (read, never written any more)."""
    return os.path.join(directory, f"step-{step:09d}.weights.h5")


def state_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.state")


def data_path(directory: str, meta: dict) -> str:
    """The file that holds a backup's variables, by its metadata's format."""
    return (state_path if "variables" in meta else _weights_path)(directory, meta["step"])


def meta_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.json")


def callbacks_path(directory: str, step: int) -> str:
    """The user's callbacks' arrays at a step (`user_view.callback_arrays`), when any."""
    return os.path.join(directory, f"step-{step:09d}.callbacks.npz")


def write_arrays(path: str, arrays: dict) -> None:
    """`arrays` (names to arrays) as one `.npz`, through a temporary name, synced, renamed."""
    with open(f"{path}.writing", "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.writing", path)


def read_arrays(directory: str | None, meta: dict) -> dict | None:
    """The callbacks' arrays a backup's metadata names, from `directory`; `None` when it names
    none or they are not there (a state handed over by a peer, whose disk they are on)."""
    if not directory or not meta.get("callback_arrays"):
        return None
    try:
        with np.load(os.path.join(directory, meta["callback_arrays"])) as held:
            return {name: held[name] for name in held.files}
    except OSError:
        return None


class Writer:
    """Writes this process's backups and checkpoints in the background, in the order asked.

    One thread, started at the first job: a step waits only while its state is taken
    (`snapshot`: no copy); writing, syncing, checksumming and renaming happen here, while
    training goes on. A job's error is raised by the next `wait()`. `write_seconds` adds up
    the time spent writing.
    """

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._errors: list = []
        self.write_seconds = 0.0

    def submit(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="distrib_tf-backup-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _work(self):
        while True:
            job = self._jobs.get()
            started = time.perf_counter()
            try:
                job()
            except BaseException as e:  # pylint: disable=broad-except  (raised by the next wait)
                self._errors.append(e)
            finally:
                self.write_seconds += time.perf_counter() - started
                self._jobs.task_done()

    def wait(self) -> None:
        """Returns once every job asked so far is done (its files on the disk); raises the
        first error of a job since the last `wait`."""
        self._jobs.join()
        if self._errors:
            error, self._errors[:] = self._errors[0], []
            raise error


WRITER = Writer()
atexit.register(WRITER.wait)  # A script's end waits for the backup in flight.


def state_variables(model, others=()) -> list:
    """What a backup holds: every variable of the model (its `SeedGenerator`s' states
    included, which `save_weights` leaves out), of its optimizer and of the optimizers it
    holds besides (`others`: `distrib_tf.keras.held_optimizers.variables`), once each, in order."""
    return list({id(v): v for v in [*model.variables, *model.optimizer.variables, *others]}.values())


def describe_variables(variables) -> list:
    """`[path, dtype, shape]` of each variable: what a backup's file holds, in that order."""
    return [[v.path, np.dtype(v.dtype).name, list(v.shape)] for v in variables]


def write_state(path: str, values) -> dict:
    """Writes the bytes of `values` (arrays or tensors) one after the other to `path` through a
    temporary name, synced, then renamed; returns the size and SHA-256 (taken from the bytes
    as they are written)."""
    writing, digest, size = f"{path}.writing", hashlib.sha256(), 0
    with open(writing, "wb") as f:
        for value in values:
            data = memoryview(np.ascontiguousarray(np.asarray(value))).cast("B")
            digest.update(data)
            f.write(data)
            size += len(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(writing, path)
    return {"bytes": size, "sha256": digest.hexdigest()}


def write_json_atomically(path: str, content: dict) -> None:
    """Writes `content` to `path` through a temporary file and a rename, synced: whole or not at all."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(os.path.dirname(path) or ".")


def remove_backups(directory: str) -> None:
    """Deletes this worker's backups once the run is over, and `backup/` once empty. Several
    workers may delete one gone task's backups at once (a grow on a shared disk): a file
    another one deleted first is gone, as asked."""
    for path in glob.glob(os.path.join(glob.escape(directory), "step-*")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    for folder in (directory, os.path.dirname(directory)):
        try:
            os.rmdir(folder)
        except OSError:  # Not empty (another worker's backups on a shared disk), or gone.
            return


def finish(directory: str) -> None:
    """At a run's clean end: keeps this worker's newest backup, marked `finished`, and
    deletes the others. The same script run again resumes at its last step (each `fit`
    returns at once, with its History); another script's run starts over (`retire_finished`)."""
    held = list_backups(directory)
    for old in held[:-1]:
        remove_step(directory, old["step"])
    if held and not held[-1].get("finished"):
        write_json_atomically(meta_path(directory, held[-1]["step"]), {**held[-1], "finished": True})


def retire_finished(directory: str, *, run: str) -> list[int]:
    """Deletes `directory`'s backups when they are all a finished run's of another `run` (the
    script changed since): they hold nothing to resume. Returns the steps deleted."""
    held = list_backups(directory)
    if not held or not all(b.get("finished") and b.get("run") != run for b in held):
        return []
    remove_backups(directory)
    return [b["step"] for b in held]


def readable(directory: str, *, run: str):
    """The intact backups of `run` that this worker can read, newest first, as `(folder,
    metadata)`: in its own `directory` or beside it, any task's (its own first at a tie).
    Each is checked against its SHA-256 only when reached: a caller that stops at the
    first whole one checks no older one."""
    candidates = []
    parent = os.path.dirname(directory)
    for rank, folder in enumerate([directory, *sorted(set(_siblings(parent)) - {directory})]):
        candidates += [(-meta["step"], rank, folder, meta) for meta in metadata_of(folder) if meta.get("run") == run]
    for _, _, folder, meta in sorted(candidates, key=lambda c: c[:2]):
        if _intact(data_path(folder, meta), meta):
            yield folder, meta


def other_runs(directory: str, *, run: str) -> list[dict]:
    """The metadata of the backups in `directory` of a run other than `run`, unchecked."""
    return [meta for meta in metadata_of(directory) if meta.get("run") != run]


def _siblings(parent: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(glob.escape(parent), "*")) if os.path.isdir(p)]


def metadata_of(directory: str) -> list[dict]:
    """Every backup's metadata in `directory`, unchecked."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "step-*.json")):
        if _NAME.search(path):
            try:
                with open(path, encoding="utf-8") as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and isinstance(meta.get("step"), int):
                found.append(meta)
    return found


def retire_gone(directory: str, *, run: str, tasks, below: int) -> None:
    """Deletes, beside `directory`, the backups of `run` older than `below` of the tasks that
    the layout (`tasks`) no longer has: once this worker has backed up `below` on the same
    disk, they can never be the newest state again."""
    present = {task_dirname(t) for t in tasks}
    for other in _siblings(os.path.dirname(directory)):
        if os.path.basename(other) in present:
            continue
        for meta in metadata_of(other):
            if meta.get("run") == run and meta["step"] < below:
                remove_step(other, meta["step"])
        try:
            os.rmdir(other)
        except OSError:  # Not empty (another run's backups), or gone.
            pass


def clear_run(directory: str, *, run: str) -> list[int]:
    """`fresh_start`: deletes every backup in `directory` (this task's own) and every backup
    of `run` beside it (every task's this worker can see; another run's stay). Returns the
    steps deleted."""
    steps = []
    for folder in {directory, *_siblings(os.path.dirname(directory))}:
        for meta in metadata_of(folder):
            if folder == directory or meta.get("run") == run:
                remove_step(folder, meta["step"])
                steps.append(meta["step"])
    return sorted(set(steps))


def remove_step(directory: str, step: int) -> None:
    """Deletes one backup, its metadata first (without it the weights are no backup). A file
    another worker deleted first (a shared disk) is gone, as asked."""
    for path in (meta_path(directory, step), state_path(directory, step), _weights_path(directory, step),
                 callbacks_path(directory, step)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


