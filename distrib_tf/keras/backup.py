"""Backups that every worker keeps on its own disk, and one resume point agreed by all.

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
`distrib_tf.keras.resume`'s: this module reads and writes one worker's files.

What is kept where: each task writes only its own directory, keeping its last 2 backups.
The backups of tasks a layout no longer has are read, never written; a worker deletes
those beside its own once it has backed up a newer step (`retire_gone`), and a
`fresh_start` deletes every backup of the run it can see (`clear_run`). At a clean end
each task keeps its last backup, marked finished (`finish`).

Example:

    >>> callback = WorkerBackup("/tmp/run/backup/worker-0", run="3fa2c1", task="worker:0",
    ...                         steps_per_epoch=100, every_steps=50)
    >>> [b["step"] for b in list_backups("/tmp/run/backup/worker-0")]
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

import keras
import numpy as np
import tensorflow as tf

from distrib_tf import events
from distrib_tf.keras import steps as steps_lib
from distrib_tf.keras import user_view

_NAME = re.compile(r"step-(\d+)\.json$")


def task_dirname(task: str) -> str:
    """`worker:1` -> `worker-1`: a directory name for a task's own backups."""
    return task.replace(":", "-")


def list_backups(directory: str) -> list[dict]:
    """The complete, intact backups in `directory`, oldest first (their metadata)."""
    found = [m for m in _metadata(directory) if _intact(data_path(directory, m), m)]
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


def _state_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.state")


def data_path(directory: str, meta: dict) -> str:
    """The file that holds a backup's variables, by its metadata's format."""
    return (_state_path if "variables" in meta else _weights_path)(directory, meta["step"])


def _meta_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.json")


def _callbacks_path(directory: str, step: int) -> str:
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


def state_variables(model) -> list:
    """What a backup holds: every variable of the model (its `SeedGenerator`s' states
    included, which `save_weights` leaves out) and of its optimizer, once each, in order."""
    return list({id(v): v for v in [*model.variables, *model.optimizer.variables]}.values())


def describe_variables(variables) -> list:
    """`[path, dtype, shape]` of each variable: what a backup's file holds, in that order."""
    return [[v.path, np.dtype(v.dtype).name, list(v.shape)] for v in variables]


def snapshot(variables) -> list:
    """The variables' values now, as tensors, without copying them: TensorFlow copies a
    variable's buffer when it is next updated while a tensor still refers to it, so the
    tensors keep this step's values. A step waits about a millisecond, whatever the
    model's size (measured: 1.3 ms for 400 MB; a copy into numpy took 0.1 to 0.7 s)."""
    return [tf.convert_to_tensor(v.value) for v in variables]


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


class WorkerBackup(keras.callbacks.Callback):
    """Saves this worker's training state into its own `directory`.

    Every worker runs it (unlike Keras's `BackupAndRestore`, which only the chief may
    write under `distrib_tf`): at every epoch end and, with `every_steps`, every
    `every_steps` global steps. The step waits while the state is taken (`snapshot`);
    the files are written in the background (`WRITER`), the next backup waiting for the
    one before to be on the disk (at most one state held in memory besides the model's). `flush()` waits
    for it; `fit`'s end, a preemption and a rollback do.

    Args:
        directory: this worker's own backup directory (on its own disk).
        run: identifies the run; a backup of another run is never restored.
        task: this worker's name, for the metadata (e.g. `"worker:1"`).
        every_steps: also back up every this many global steps; `None`: epochs only.
        keep: how many backups to keep (at least 2, so that the workers always share
            one while a save is in progress on some of them).
        steps_per_epoch: global steps per epoch, to record the epoch of a step.
        history: the user's logs of the epochs already finished (`{"epoch": 1, "loss": ...}`),
            to which each epoch's end adds its own.
        layout: the layout's training tasks: once a step is backed up, the older backups
            beside it of tasks not in it are deleted (`retire_gone`). `None`: none are.
        rollbacks: the rollbacks so far (`{"at_step", "to_step", "learning_rate"}`), kept in
            every backup: a restart goes on with the learning rate and the count they left.
        asynchronous: write in the background (default); False: each save waits for its files.
        steps: the stage's step counter (`distrib_tf.keras.steps`); default: the optimizer's.
    """

    def __init__(self, directory: str, *, run: str, task: str, steps_per_epoch: int,
                 every_steps: int | None = None, keep: int = 2, history: list | None = None,
                 callbacks=(), epoch_metrics: list | None = None, layout=None, rollbacks: list | None = None,
                 asynchronous: bool = True, steps: steps_lib.StageSteps | None = None):
        super().__init__()
        self.directory, self.run, self.task = directory, run, task
        self.steps_per_epoch, self.every_steps, self.keep = steps_per_epoch, every_steps, max(keep, 2)
        self.steps = steps or steps_lib.StageSteps()
        self.step = 0  # The stage's global steps finished (`self.steps`).
        self.saved_step = None
        self.history = list(history or [])
        self.callbacks = list(callbacks)  # The user's: their states go into every backup.
        self._weights: dict = {}  # What the metadata says of the step's weights, once written.
        self.epoch_metrics = epoch_metrics  # The resumed epoch's metric sums so far, restored at its start.
        self.layout, self.retired_below = (None if layout is None else tuple(layout)), -1
        self.rollbacks = list(rollbacks or [])
        self.asynchronous = asynchronous
        self.blocked_seconds: list[float] = []  # What each save cost the step that made it.

    def on_train_begin(self, logs=None):
        self.step = self.steps(self.model)
        if self.step == 0:
            self.save()  # The starting point, for a rollback before the first backup.

    def on_train_batch_end(self, batch, logs=None):
        before, self.step = self.step, self.steps(self.model)  # Once an execution: maybe several steps.
        if self.every_steps and steps_lib.crossed(before, self.step, self.every_steps):
            self.save()

    def on_epoch_begin(self, epoch, logs=None):
        if self.epoch_metrics is not None:  # After Keras's reset: the epoch goes on from them.
            set_metric_sums(self.model, self.epoch_metrics)
            self.epoch_metrics = None

    def on_epoch_end(self, epoch, logs=None):
        self.history = [h for h in self.history if h["epoch"] <= epoch]
        self.history.append({"epoch": epoch + 1, **user_view.users_logs(logs)})
        self.save()

    def on_train_end(self, logs=None):
        self.flush()

    def flush(self) -> None:
        """Waits until every backup asked for is on the disk."""
        WRITER.wait()

    def save(self):
        """Backs up the current step: its state copied now, its files written in the
        background (weights first, metadata last). A step already saved (at a batch's end,
        then its epoch's) gets its metadata written again: the epoch's logs and the
        callbacks' states came since."""
        started = time.perf_counter()
        WRITER.wait()  # The backup before is whole on the disk: one state held at most.
        step, arrays = self.step, None
        state = {}
        if self.saved_step != step:
            variables = state_variables(self.model)
            arrays = snapshot(variables)
            state["variables"] = describe_variables(variables)
            if step % self.steps_per_epoch:  # Inside an epoch: the sums its History value needs.
                state["metrics"] = metric_sums(self.model)
        meta = {"run": self.run, "step": step, "epoch": step // self.steps_per_epoch, "task": self.task,
                "history": list(self.history), "callbacks": user_view.callback_states(self.callbacks),
                "stopped": bool(self.model.stop_training), "rollbacks": list(self.rollbacks),
                **({} if self.layout is None else {"layout": list(self.layout)})}
        held = user_view.callback_arrays(self.callbacks)  # EarlyStopping's best weights, as they are now.
        if held:
            meta["callback_arrays"] = os.path.basename(_callbacks_path(self.directory, step))
        self.saved_step = step
        WRITER.submit(lambda: self._write(step, arrays, state, meta, held))
        if not self.asynchronous:
            WRITER.wait()
        self.blocked_seconds.append(time.perf_counter() - started)

    def _write(self, step: int, arrays, state: dict, meta: dict, held: dict) -> None:
        """In the background: the variables (unless `arrays` is None: written already) and the
        callbacks' arrays, then the metadata, which makes the backup count; then the older
        backups go."""
        if arrays is not None:
            make_private_dirs(self.directory)
            self._weights = {**write_state(_state_path(self.directory, step), arrays), **state}
        if held:
            write_arrays(_callbacks_path(self.directory, step), held)
        meta_path = _meta_path(self.directory, step)
        with open(meta_path + ".writing", "w", encoding="utf-8") as f:
            json.dump({**meta, **self._weights}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync(self.directory)  # The weights' rename is on the disk before the metadata's.
        os.replace(meta_path + ".writing", meta_path)
        fsync(self.directory)
        events.emit("backup", step=step)
        for old in sorted(_metadata(self.directory), key=lambda m: m["step"])[: -self.keep]:
            _remove(self.directory, old["step"])  # (By their metadata: reading their weights back costs.)
        if self.layout is not None and step > self.retired_below:  # Older states of gone tasks.
            retire_gone(self.directory, run=self.run, tasks=self.layout, below=step)
            self.retired_below = step


def metric_sums(model) -> list:
    """This worker's own share of every compiled metric's state (its replicas' parts of each
    on-read variable, as they are: no collective), for the epoch's History value."""
    strategy = model.distribute_strategy
    return [[np.asarray(part.numpy()).tolist() for part in strategy.experimental_local_results(v.value)]
            for v in model.metrics_variables]


def set_metric_sums(model, sums: list) -> None:
    """Restores `metric_sums` on the layout it was taken on (elsewhere the resumed epoch's
    value covers the steps after the resume only)."""
    strategy, variables = model.distribute_strategy, model.metrics_variables
    parts = [strategy.experimental_local_results(v.value) for v in variables]
    if len(sums) != len(parts) or any(len(a) != len(b) for a, b in zip(sums, parts)):
        return
    for saved, local in zip(sums, parts):
        for value, part in zip(saved, local):
            part.assign(np.asarray(value, dtype=part.dtype.as_numpy_dtype).reshape(part.shape))


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
        _remove(directory, old["step"])
    if held and not held[-1].get("finished"):
        write_json_atomically(_meta_path(directory, held[-1]["step"]), {**held[-1], "finished": True})


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
        candidates += [(-meta["step"], rank, folder, meta) for meta in _metadata(folder) if meta.get("run") == run]
    for _, _, folder, meta in sorted(candidates, key=lambda c: c[:2]):
        if _intact(data_path(folder, meta), meta):
            yield folder, meta


def other_runs(directory: str, *, run: str) -> list[dict]:
    """The metadata of the backups in `directory` of a run other than `run`, unchecked."""
    return [meta for meta in _metadata(directory) if meta.get("run") != run]


def _siblings(parent: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(glob.escape(parent), "*")) if os.path.isdir(p)]


def _metadata(directory: str) -> list[dict]:
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
        for meta in _metadata(other):
            if meta.get("run") == run and meta["step"] < below:
                _remove(other, meta["step"])
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
        for meta in _metadata(folder):
            if folder == directory or meta.get("run") == run:
                _remove(folder, meta["step"])
                steps.append(meta["step"])
    return sorted(set(steps))


def _remove(directory: str, step: int) -> None:
    """Deletes one backup, its metadata first (without it the weights are no backup). A file
    another worker deleted first (a shared disk) is gone, as asked."""
    for path in (_meta_path(directory, step), _state_path(directory, step), _weights_path(directory, step),
                 _callbacks_path(directory, step)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


