"""Backups that every worker keeps on its own disk, and one resume point agreed by all.

Hosts need not share a disk. Every worker (the chief too) writes its own backups into
its own directory, `model_dir/backup/<task>/` on its own host:

    step-000000120.weights.h5   the model and optimizer variables after global step 120
    step-000000120.json         {"run": ..., "step": 120, "epoch": 3, "task": "worker:1",
                                 "seeds": [...], "history": [...]}

The metadata also holds what `save_weights` leaves out: the state of every
`SeedGenerator` of the model (each `Dropout`, random augmentation or noise layer), so that
a resumed run draws the masks the uninterrupted one would, and the logs of every epoch
finished (the user's History, whole across restarts).

The `.json` file is written last and atomically: a backup without it does not exist, so
a process killed while writing leaves the previous backup whole. Both files and the
directory are synced to the disk before the metadata counts (a machine that crashes
cannot leave metadata pointing at weights still in its page cache), and the metadata
holds the weights' size and SHA-256: a backup whose weights do not match is not listed,
so every worker advertises only backups that will load, and all of them fall back to the
newest one they all hold intact. The last `keep` backups are kept. Keras 3 saving runs
no collectives, so each worker saves alone.

On a start, `agree_on_resume()` gathers from every worker which steps it holds (one
all-gather, before training) and every worker takes the same decision:

- no worker holds a backup: start at step 0;
- all hold backups of this run: resume at the latest step that all of them hold;
- some hold backups of this run and others none (a host that lost its disk, or one added
  to the job): the latest step that all holders hold; a worker without it gets that step's
  state from one that has it over the collective (`share_state`), exactly;
- otherwise (another run's, or no step in common): a `ResumeError` naming the worker and
  what it holds, raised on every worker alike, so none hangs.

On another layout (`resume_source`): a worker whose own directory is empty reads the
backups beside it of a task the layout no longer has, so a job preempted on 2 workers
resumes on 1 process, or on fewer workers, over the disk they wrote; the state (the step,
the weights, the optimizer's slots) is the same whatever the layout. A worker added on a
disk of its own gets it from its peers, as above: no layout starts again at 0 silently.

Example:

    >>> callback = WorkerBackup("/tmp/run/backup/worker-0", run="3fa2c1", task="worker:0",
    ...                         every_steps=50)
    >>> step = agree_on_resume(model, "/tmp/run/backup/worker-0", run="3fa2c1", task="worker:0")
"""

import fcntl
import glob
import hashlib
import json
import os
import re
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from distrib_tf import events
from distrib_tf.keras import phases
from distrib_tf.keras import user_view

_NAME = re.compile(r"step-(\d+)\.json$")
_JOB_CODES = {"chief": 0, "worker": 1}
_NONE, _OURS, _FOREIGN = 0, 1, 2


class ResumeError(RuntimeError):
    """The workers' backups do not give one resume point."""


def task_dirname(task: str) -> str:
    """`worker:1` -> `worker-1`: a directory name for a task's own backups."""
    return task.replace(":", "-")


def list_backups(directory: str) -> list[dict]:
    """The complete, intact backups in `directory`, oldest first (their metadata)."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "step-*.json")):
        if not _NAME.search(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if _intact(_weights_path(directory, meta.get("step", -1)), meta):
            found.append(meta)
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
    return os.path.join(directory, f"step-{step:09d}.weights.h5")


def _meta_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.json")


class WorkerBackup(keras.callbacks.Callback):
    """Saves this worker's training state into its own `directory`.

    Every worker runs it (unlike Keras's `BackupAndRestore`, which only the chief may
    write under `distrib_tf`): at every epoch end and, with `every_steps`, every
    `every_steps` global steps.

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
    """

    def __init__(self, directory: str, *, run: str, task: str, steps_per_epoch: int,
                 every_steps: int | None = None, keep: int = 2, history: list | None = None,
                 callbacks=(), epoch_metrics: list | None = None):
        super().__init__()
        self.directory, self.run, self.task = directory, run, task
        self.steps_per_epoch, self.every_steps, self.keep = steps_per_epoch, every_steps, max(keep, 2)
        self.step = 0  # Global steps finished, counted from the optimizer at train begin.
        self.saved_step = None
        self.history = list(history or [])
        self.callbacks = list(callbacks)  # The user's: their states go into every backup.
        self._weights: dict = {}  # What the metadata says of the step's weights, once written.
        self.epoch_metrics = epoch_metrics  # The resumed epoch's metric sums so far, restored at its start.

    def on_train_begin(self, logs=None):
        self.step = int(self.model.optimizer.iterations.numpy())
        if self.step == 0:
            self.save()  # The starting point, for a rollback before the first backup.

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.every_steps and self.step % self.every_steps == 0:
            self.save()

    def on_epoch_begin(self, epoch, logs=None):
        if self.epoch_metrics is not None:  # After Keras's reset: the epoch goes on from them.
            set_metric_sums(self.model, self.epoch_metrics)
            self.epoch_metrics = None

    def on_epoch_end(self, epoch, logs=None):
        self.history = [h for h in self.history if h["epoch"] <= epoch]
        self.history.append({"epoch": epoch + 1, **user_view.users_logs(logs)})
        self.save()

    def save(self):
        """Writes the backup of the current step (weights first, metadata last). A step
        already saved (at a batch's end, then its epoch's) gets its metadata written again:
        the epoch's logs and the callbacks' states came since."""
        weights = _weights_path(self.directory, self.step)
        if self.saved_step != self.step:
            make_private_dirs(self.directory)
            writing = weights[: -len(".weights.h5")] + ".writing.weights.h5"
            self.model.save_weights(writing, overwrite=True)
            fsync(writing)
            os.replace(writing, weights)
            self._weights = {"bytes": os.path.getsize(weights), "sha256": _sha256(weights),
                             "seeds": [v.numpy().tolist() for v in seed_states(self.model)]}
            if self.step % self.steps_per_epoch:  # Inside an epoch: the sums its History value needs.
                self._weights["metrics"] = metric_sums(self.model)
        meta = {"run": self.run, "step": self.step, "epoch": self.step // self.steps_per_epoch,
                "task": self.task, **self._weights, "history": self.history,
                "callbacks": user_view.callback_states(self.callbacks), "stopped": bool(self.model.stop_training)}
        meta_path = _meta_path(self.directory, self.step)
        with open(meta_path + ".writing", "w", encoding="utf-8") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        fsync(self.directory)  # The weights' rename is on the disk before the metadata's.
        os.replace(meta_path + ".writing", meta_path)
        fsync(self.directory)
        self.saved_step = self.step
        events.emit("backup", step=self.step)
        for old in list_backups(self.directory)[: -self.keep]:
            for path in (_meta_path(self.directory, old["step"]), _weights_path(self.directory, old["step"])):
                if os.path.exists(path):
                    os.remove(path)


def seed_states(model) -> list:
    """The state variables of `model`'s `SeedGenerator`s (in `model.variables`, not in
    what `save_weights` writes)."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


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


def read_meta(directory: str, step: int) -> dict:
    """The metadata of this worker's backup of `step` in `directory`, or `{}`."""
    try:
        with open(_meta_path(directory, step), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def hold(directory: str, *, wait_seconds: float = 120.0) -> int:
    """Holds `directory` (an exclusive `flock` on the directory itself, no file added) for as
    long as this process runs, waiting up to `wait_seconds` for a process that holds it to
    end: two processes of one task (a worker stopping beside its replacement, under Ray)
    never write or prune the same backups. Returns the descriptor that holds it (keep it).

    Raises:
        ResumeError: another process still holds it after `wait_seconds`.
    """
    make_private_dirs(directory)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise ResumeError(f"Cannot resume: another process still holds {directory} after "
                                  f"{wait_seconds:.0f} s. Expected it to end first (a process of this task "
                                  "still running, such as one a restarted Ray worker left): stop it, or wait "
                                  "for it.") from None
            time.sleep(0.2)


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
        for path in (_meta_path(directory, old["step"]), _weights_path(directory, old["step"])):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
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


def resume_source(directory: str, *, run: str, tasks) -> str:
    """Where this worker resumes from: its own `directory`, or, when that holds no backup,
    the newest of this run's backups beside it of a task that is not in `tasks` (the
    layout's training tasks): a job resumed on fewer workers, or on one process, over a
    disk that the gone tasks wrote to. Those backups are read, never written or pruned.

    Example:

        >>> resume_source("runs/x/backup/chief-0", run="3fa2c1", tasks=["chief:0"])
        'runs/x/backup/worker-0'
    """
    if list_backups(directory):
        return directory
    parent, present = os.path.dirname(directory), {task_dirname(t) for t in tasks}
    best, newest = directory, -1
    for other in sorted(glob.glob(os.path.join(glob.escape(parent), "*"))):
        if os.path.basename(other) in present or not os.path.isdir(other):
            continue
        ours = [b for b in list_backups(other) if b.get("run") == run]
        if ours and ours[-1]["step"] > newest:
            best, newest = other, ours[-1]["step"]
    return best


def remove_gone(directory: str, *, run: str, tasks) -> None:
    """At a run's end: deletes the backups beside `directory` of this run's tasks that the
    layout no longer has (`resume_source`), leaving any other run's alone."""
    present = {task_dirname(t) for t in tasks}
    for other in glob.glob(os.path.join(glob.escape(os.path.dirname(directory)), "*")):
        held = list_backups(other) if os.path.isdir(other) else []
        if os.path.basename(other) not in present and held and all(b.get("run") == run for b in held):
            remove_backups(other)


def _describe_local(directory: str, run: str, task: str) -> np.ndarray:
    job, index = task.split(":")
    backups = list_backups(directory)
    foreign = [b for b in backups if b.get("run") != run]
    status = _FOREIGN if foreign else (_OURS if backups else _NONE)
    steps = [b["step"] for b in backups][-2:]
    steps = [-1] * (2 - len(steps)) + steps
    return np.array([_JOB_CODES.get(job, 1), int(index), status, *steps], dtype=np.int64)


def gather_rows(strategy, row: np.ndarray) -> np.ndarray:
    """Every replica's copy of its worker's `row`, stacked in replica order (one all-gather)."""
    values = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(row[None, :]))
    return strategy.gather(values, axis=0).numpy()


def agree_on_resume(model, directory: str, *, run: str, task: str, include_start: bool = False) -> int:
    """Agrees with every worker on the step to resume from, and restores it.

    Must be called by every worker at the same point, after `compile` and before `fit`.
    The backup of step 0 (the starting point) is restored only with `include_start`, which
    a rollback uses; a resume at step 0 is a fresh start. It counts as a held step all the
    same: a worker killed while writing its first backup after the start holds step 0 only
    while its peers hold that first backup too, and every worker starts again at 0 (this
    failed with "holds no backup" when step 0 did not count).

    Returns:
        The global step restored (0: a fresh start, nothing restored).
    Raises:
        ResumeError: the workers' backups give no common resume point; every worker
            raises the same error.
    """
    strategy = model.distribute_strategy
    row = _describe_local(directory, run, task)
    phases.enter(strategy, "agree_on_resume")  # A worker slow to start is not a dead one.
    rows = gather_rows(strategy, row)
    step = decide(rows)
    if step or include_start:
        with strategy.scope():
            if not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        if _holds(row, step):
            model.load_weights(_weights_path(directory, step))
            seeds = read_meta(directory, step).get("seeds")
            for variable, value in zip(seed_states(model), seeds or ()):  # Older backups hold none.
                variable.assign(np.asarray(value, dtype=variable.dtype))
        share_state(model, rows, step, row)
    return step


def decide(rows: np.ndarray) -> int:
    """The resume step from every worker's `[job, index, status, step, step]` row."""
    workers = {}
    for job, index, status, *steps in rows.tolist():
        name = f"{'chief' if job == 0 else 'worker'}:{index}"
        workers[name] = (status, [s for s in steps if s >= 0])
    if all(status == _NONE for status, _ in workers.values()):
        return 0
    foreign = [name for name, (status, _) in workers.items() if status == _FOREIGN]
    if foreign:
        raise ResumeError(
            f"Cannot resume: {foreign[0]} holds a backup of a different run in its "
            "model_dir/backup/ (another config or job). Expected backups of this run only: "
            "use a new --model_dir, or remove that host's old backup."
        )
    holding = {name: steps for name, (status, steps) in workers.items() if status == _OURS}
    common = set.intersection(*(set(steps) for steps in holding.values()))
    if not common:
        held = "; ".join(f"{name} holds steps {steps}" for name, steps in holding.items())
        raise ResumeError(f"Cannot resume: no step that every worker holds ({held}).")
    return max(common)  # A worker that holds none gets it from one that does (`share_state`).


def _holds(row, step: int) -> bool:
    return row[2] == _OURS and step in row[3:]


def share_state(model, rows: np.ndarray, step: int, own_row: np.ndarray) -> bool:
    """Gives the state of `step` to every worker that holds no backup of it, from the first
    replica that does: every variable of the model and its optimizer in one all-reduce, in
    float64, where only that replica adds its values (exact: x + 0 is x, and float32 and
    integer counts below 2**53 pass through float64 unchanged). Returns whether it ran.

    Every worker calls it at the same point with the same `rows` (one per replica).
    """
    holders = [r for r, row in enumerate(rows) if _holds(row, step)]
    if len(holders) == len(rows):
        return False
    strategy, source = model.distribute_strategy, holders[0]
    variables = list({id(v): v for v in [*model.variables, *model.optimizer.variables]}.values())

    @tf.function
    def summed():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            flat = tf.concat([tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables], 0)
            mine = tf.equal(context.replica_id_in_sync_group, source)
            return context.all_reduce("SUM", tf.where(mine, flat, tf.zeros_like(flat)))
        return strategy.run(replica_fn)

    flat = strategy.experimental_local_results(summed())[0].numpy()
    offset = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        variable.assign(flat[offset:offset + size].reshape(variable.shape).astype(variable.dtype))
        offset += size
    if not _holds(own_row, step):
        events.emit("state_received", step=step)
    return True
