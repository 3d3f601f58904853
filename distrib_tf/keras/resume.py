"""One resume point for every worker, whatever layout wrote the backups, and its state for all.

Before training, each worker holds (`backup.readable`) the backups it can read on its own
disk: its own task's directory, `model_dir/backup/<task>/`, and the directories beside it
(other tasks' on a shared disk; the tasks of a former layout). What each worker holds,
who sends and what every worker receives:

1. Every worker describes its newest backup of this run (`newest`: the step, the size of
   its metadata, whether it is the task's own) in one row, and whether its own directory
   holds another run's; one all-gather gives every worker every replica's row
   (`gather_rows`).
2. Every worker takes the same decision from the same rows (`decide`): the newest step any
   worker can read (a backup of a step holds that step's state whatever layout wrote it, so
   2 workers, then 1 process, then 2 again resume at the single process's last step); no
   backup anywhere: step 0; another run's backups in a task's own directory: a
   `ResumeError` naming it, on every worker alike, so none hangs.
3. Every worker that holds that step loads it from its disk. If some cannot (a host that
   lost its disk or joined the job), exactly one sends: the first replica that holds it,
   its backup's metadata before anyone loads (`_share_metadata`: every worker then builds
   what it names at one point), then its variables (`share_state`), each in one float64
   all-reduce to which every other replica, holders too, adds zeros of the same shape. A worker that
   holds the step keeps its own metadata (its own metric sums inside an epoch); every
   other one receives the source's, bytes for bytes.

`hold` comes first: one process of a task at a time reads and writes its directory.

Example:

    >>> resume = agree_on_resume(model, "/tmp/run/backup/worker-0", run="3fa2c1", task="worker:0")
    >>> resume.step, resume.meta["history"]
"""

import fcntl
import json
import os
import time
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from distrib_tf import events
from distrib_tf.keras import backup
from distrib_tf.keras import held_optimizers
from distrib_tf.keras import phases

_JOB_CODES = {"chief": 0, "worker": 1}
_NONE, _OURS, _FOREIGN = 0, 1, 2


class ResumeError(RuntimeError):
    """The workers' backups do not give one resume point."""


def hold(directory: str, *, wait_seconds: float = 120.0) -> int:
    """Holds `directory` (an exclusive `flock` on the directory itself, no file added) for as
    long as this process runs, waiting up to `wait_seconds` for a process that holds it to
    end: two processes of one task (a worker stopping beside its replacement, under Ray)
    never write or prune the same backups. Returns the descriptor that holds it (keep it).

    Raises:
        ResumeError: another process still holds it after `wait_seconds`.
    """
    backup.make_private_dirs(directory)
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


def load_state(model, path: str, meta: dict) -> None:
    """Restores a backup's variables into `model` (and its optimizers, built)."""
    variables = _state_variables(model, meta)
    held = meta["variables"]
    mine = backup.describe_variables(variables)  # Matched by order, type and shape (as `load_weights` does):
    if [h[1:] for h in held] != [m[1:] for m in mine]:  # a model built again gets other names.
        first = next((f"{h} in the backup, {m} in the model" for h, m in zip(held, mine) if h[1:] != m[1:]),
                     f"{len(held)} variables in the backup, {len(mine)} in the model")
        raise ResumeError(f"Cannot resume from {path}: its variables are not this model's ({first}). Expected "
                          "the model and optimizer that wrote it: use fresh_start, or another model_dir.")
    with open(path, "rb") as f:
        for variable, (_, dtype, shape) in zip(variables, held):
            count = int(np.prod(shape))
            variable.assign(np.fromfile(f, dtype=np.dtype(dtype), count=count).reshape(shape))


def _state_variables(model, meta: dict) -> list:
    """The variables a backup with metadata `meta` holds, in its order (the optimizers it names
    that the model holds besides `model.optimizer`: built by `agree_on_resume`, on every worker
    at one point)."""
    return backup.state_variables(model, held_optimizers.variables(model, meta.get("optimizers") or []))


def seed_states(model) -> list:
    """The state variables of `model`'s `SeedGenerator`s (in `model.variables`, not in
    what `save_weights` writes)."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


class Found(NamedTuple):
    """A backup this worker can read: the directory that holds it, and its metadata."""
    directory: str
    meta: dict


def newest(directory: str, *, run: str) -> Found | None:
    """The newest intact backup of `run` that this worker can read: in its own `directory` or
    beside it, any task's (at a step, every worker's state is the same: the backups of one
    run are of one training, whatever layout wrote them). Its own at a tie. Only the
    candidates from the newest down are checked against their SHA-256, until one is whole.
    Backups of another run beside it are not this run's state and are left alone.

    Example:

        >>> newest("runs/x/backup/chief-0", run="3fa2c1")  # After 2 workers, then 1 process.
        Found(directory='runs/x/backup/chief-0', meta={'step': 101, ...})
    """
    return next((Found(folder, meta) for folder, meta in backup.readable(directory, run=run)), None)


def _describe_local(directory: str, run: str, task: str, found: Found | None) -> np.ndarray:
    """This worker's row: `[job, index, status, newest step it can read or -1, its metadata's
    size, whether that backup is this task's own]`."""
    job, index = task.split(":")
    foreign = backup.other_runs(directory, run=run)
    status = _FOREIGN if foreign else (_OURS if found else _NONE)
    step, size = (found.meta["step"], len(_encode(found.meta))) if found else (-1, 0)
    own = found is not None and found.directory == directory and found.meta.get("task") == task
    return np.array([_JOB_CODES.get(job, 1), int(index), status, step, size, own], dtype=np.int64)


def _encode(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True).encode()


def gather_rows(strategy, row: np.ndarray) -> np.ndarray:
    """Every replica's copy of its worker's `row`, stacked in replica order (one all-gather)."""
    values = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(row[None, :]))
    return strategy.gather(values, axis=0).numpy()


class Resume(NamedTuple):
    """Where the workers agreed to resume: the global `step` (0: a fresh start), the
    backup's metadata (the History, the callbacks' states...; `{}` on a fresh start), the
    directory this worker read it from (`None`: received from a worker that holds it), and
    whether every worker read its own task's backup of the step (what periodic sync needs,
    whose workers' weights differ between averages)."""
    step: int
    meta: dict
    source: str | None
    all_own: bool = False


def agree_on_resume(model, directory: str, *, run: str, task: str, include_start: bool = False) -> Resume:
    """Agrees with every worker on the step to resume from, and restores it.

    Must be called by every worker at the same point, after `compile` and before `fit`.
    The step is the newest any worker can read (`newest`: its own backups or those beside
    them, any layout's); every worker that can read it loads it, and the others receive it
    from one that did (`share_state`). The backup of step 0 (the starting point) is
    restored only with `include_start`, which a rollback uses; a resume at step 0 is a
    fresh start.

    Raises:
        ResumeError: a worker's own directory holds another run's backups; every worker
            raises the same error.
    """
    strategy = model.distribute_strategy
    found = newest(directory, run=run)
    row = _describe_local(directory, run, task, found)
    phases.enter(strategy, "agree_on_resume")  # A worker slow to start is not a dead one.
    rows = gather_rows(strategy, row)
    step = decide(rows)
    if not (step or include_start):
        return Resume(0, {}, None, True)
    with strategy.scope():
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    holds = found is not None and found.meta["step"] == step
    own = found.meta if holds else None
    shared = _share_metadata(strategy, rows=rows, row=row, step=step, meta=own)
    # Every worker builds the optimizers the model holds besides model.optimizer here, at one
    # point (creating a variable under MultiWorkerMirroredStrategy is a collective), from the
    # same metadata: a holder building them on its own while loading would wait for the others.
    held_optimizers.build(model, shared.get("optimizers"))
    if holds:
        path = backup.data_path(found.directory, found.meta)
        if "variables" in found.meta:
            load_state(model, path, found.meta)
        else:  # A backup of an earlier version: Keras's weights, the seeds in its metadata.
            model.load_weights(path)
            for variable, value in zip(seed_states(model), found.meta.get("seeds") or ()):
                variable.assign(np.asarray(value, dtype=variable.dtype))
    meta = share_state(model, rows=rows, step=step, meta=own, shared=shared)
    all_own = bool(all(row[3] == step and row[5] for row in rows))
    return Resume(step, meta, found.directory if holds else None, all_own)


def _metadata_sent(rows: np.ndarray, row: np.ndarray, *, source: int, meta: dict | None) -> np.ndarray:
    """What this worker adds to `_share_metadata`'s all-reduce: its encoded
    metadata from the source replica's worker; from every other, zeros of the source's
    length (`rows[source][4]`): another holder's own metadata has another length (its task,
    its own metric sums inside an epoch) and is not sent."""
    if meta is not None and tuple(row[:2]) == tuple(rows[source][:2]):  # Job and index: the source's worker.
        return np.frombuffer(_encode(meta), dtype=np.uint8).astype(np.float64)  # Its row's size, the same dict.
    return np.zeros(int(rows[source][4]), dtype=np.float64)


def decide(rows: np.ndarray) -> int:
    """The resume step from every worker's `_describe_local` row: the newest any of them can read."""
    foreign = [f"{'chief' if job == 0 else 'worker'}:{index}"
               for job, index, status, *_ in rows.tolist() if status == _FOREIGN]
    if foreign:
        raise ResumeError(
            f"Cannot resume: {foreign[0]} holds a backup of a different run in its "
            "model_dir/backup/ (another config or job). Expected backups of this run only: "
            "use a new --model_dir, or remove that host's old backup."
        )
    return max(0, int(rows[:, 3].max()))


def _share_metadata(strategy, *, rows: np.ndarray, row: np.ndarray, step: int, meta: dict | None) -> dict:
    """The metadata of `step`'s backup, on every worker: this worker's own `meta` when every
    worker holds the step; otherwise the source's (the first replica that holds it), in one
    all-reduce (`_metadata_sent`), before anyone loads its backup."""
    holders = [r for r, each in enumerate(rows) if each[3] == step]
    if len(holders) == len(rows):
        return meta
    encoded = _metadata_sent(rows, row, source=holders[0], meta=meta)
    return json.loads(_from_source(strategy, holders[0], lambda: [tf.constant(encoded)]).astype(np.uint8).tobytes())


def share_state(model, *, rows: np.ndarray, step: int, meta: dict | None, shared: dict) -> dict:
    """Gives the state of `step` to every worker that cannot read it, from the first replica
    that did (the source): every variable its metadata `shared` (`_share_metadata`'s) names
    (the model's, its optimizer's, the optimizers it holds besides, built), in one all-reduce,
    in float64, where only the source replica adds its values (exact: x + 0 is x, and float32,
    integer counts below 2**53 and bytes pass through float64 unchanged). Returns the
    metadata: this worker's own `meta` when it holds the step, else `shared`.

    Every worker calls it at the same point with the same `rows` (one per replica), the
    holders once their backup is loaded; all meet at a barrier first, so that a collective
    timeout does not run while a holder still loads a large model.
    """
    holders = [r for r, each in enumerate(rows) if each[3] == step]
    if len(holders) == len(rows):
        return meta
    strategy = model.distribute_strategy
    phases.enter(strategy, "state_loaded")
    variables = _state_variables(model, shared)
    flat = _from_source(strategy, holders[0], lambda: [v.value for v in variables])
    offset = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        variable.assign(flat[offset:offset + size].reshape(variable.shape).astype(variable.dtype))
        offset += size
    if meta is None:
        meta = shared
        events.emit("state_received", step=step)
    return meta


def _from_source(strategy, source: int, values) -> np.ndarray:
    """The tensors `values()` gives on replica `source` (read in each replica's context), flat in
    float64, on every replica: one all-reduce to which every other replica adds zeros."""

    @tf.function
    def summed():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            flat = tf.concat([tf.reshape(tf.cast(v, tf.float64), [-1]) for v in values()], 0)
            mine = tf.equal(context.replica_id_in_sync_group, source)
            return context.all_reduce("SUM", tf.where(mine, flat, tf.zeros_like(flat)))
        return strategy.run(replica_fn)

    return strategy.experimental_local_results(summed())[0].numpy()
