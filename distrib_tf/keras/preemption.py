"""Preemption that loses no step: SIGTERM, one agreed step, a backup on every worker, exit 75.

Inside a `fit` (`sigterm.guarded()`) a SIGTERM only records that it came. Between training
batches, `SaveOnPreemption` then has every worker agree on the next step through the
coordination service, back it up and raise `Preempted`; between preemptions it costs nothing
but a flag read per step, and a barrier at each epoch's end, which happens once (see
`SaveOnPreemption`). What a SIGTERM does outside the training batches (start-up,
validation, the script's own code after `fit`, the outputs) is `distrib_tf.keras.sigterm`'s;
which exit code a run leaves with, in every case, is `distrib_tf.run.ending`'s. The main
job then exits with `distrib_tf.exit_codes.PREEMPTED` (75), which the launcher forwards;
started again, the job resumes at that step (`distrib_tf.keras.backup`): no step is lost.

Example, for a Keras user's own `fit`:

    >>> strategy = distrib_tf.make_strategy()
    >>> sigterm.install()  # After the strategy: making one takes SIGTERM's handler.
    >>> backup = WorkerBackup(..., epoch_end_saves=False)
    >>> save = SaveOnPreemption(backup)
    >>> with sigterm.guarded():
    ...     model.fit(..., callbacks=[EpochEndBegins(save), backup, save])
"""

import os
import threading

import keras
import tensorflow as tf
from tensorflow.python.eager import context  # The coordination service's key-value store.

from distrib_tf.keras import phases
from distrib_tf.keras import sigterm
from distrib_tf.keras.sigterm import GRACE_ENV
from distrib_tf.keras.sigterm import Preempted

__all__ = ["GRACE_ENV", "EpochEndBegins", "Preempted", "SaveOnPreemption", "fits"]

_NONE = sigterm.NONE
_set_once = sigterm._set_once  # pylint: disable=protected-access  (one key-value helper)


_fits = [0]  # Keras fits that a SaveOnPreemption watched, in this process.


def fits() -> int:
    """How many Keras fits a `SaveOnPreemption` watched in this process: a key per fit."""
    return _fits[0]


class SaveOnPreemption(keras.callbacks.Callback):
    """Saves and stops every worker at one step once any of them received SIGTERM.

    No collective per step: the first worker told names the step after the one it has
    finished in the coordination service's key-value store and waits until every worker
    has read it (a thread on each blocks on the key). Workers that all-reduce at every
    step (gradients, or Keras's metrics under periodic sync) are never a step apart, so
    none can have passed it. TensorFlow's `PreemptionCheckpointHandler` agrees the same
    way. In one process the flag alone decides.

    An epoch's end happens once. Its last step is not backed up before that end: at that step
    every worker's backup holds the step before its last execution
    (`WorkerBackup.keep_before_last`). A SIGTERM there or in validation leaves at once with
    it, and the restart runs that execution and the whole end (validation, the History
    row, every `on_epoch_end`, the chief's checkpoint). One in an `on_epoch_end` callback is
    recorded: every worker finishes the end, they meet at a barrier, say whether a SIGTERM
    came, back up the end and leave there if one did. Only past that barrier does a worker
    back up an end, so none holds an end that another worker did not finish. (A worker that
    left in validation fails a peer's collectives in its callbacks: `kept` is what that peer
    leaves with, `distrib_tf.run.stage`.)

    Args:
        worker_backup: the `distrib_tf.keras.worker_backup.WorkerBackup` of this worker, which
            must come before this callback in `fit`'s list (it counts the steps).
        ack_timeout: seconds to wait for the other workers to read the step; by default a
            quarter of the seconds between SIGTERM and SIGKILL that the launcher gives its
            tasks (`DISTRIB_TF_GRACE_SECONDS`), else 120: the step and the backup must
            still fit in that grace after a worker that never answers.

    It backs up each epoch's end itself (its `WorkerBackup` made with `epoch_end_saves=False`)
    and comes after every callback whose `on_epoch_end` is part of that end; an
    `EpochEndBegins` of it comes before them all.
    """

    def __init__(self, worker_backup, *, ack_timeout: float | None = None):
        super().__init__()
        if ack_timeout is None:
            grace = os.environ.get(GRACE_ENV)
            ack_timeout = float(grace) / 4 if grace else 120.0
        self.worker_backup, self.ack_timeout = worker_backup, ack_timeout
        self._in_fit, self._at_once, self._kept = False, None, None

    def on_train_begin(self, logs=None):
        _fits[0] += 1  # A key per Keras fit in the process, alike on every worker (rollbacks, stages).
        self._leave_at_once()
        self._kept = None
        self._in_fit = True
        self._key, self._target, self._named = f"distrib_tf/preempt/{_fits[0]}", None, False
        resolver = getattr(self.model.distribute_strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        self._tasks = [f"{kind}:{i}" for kind in ("chief", "worker") for i in range(len(spec.get(kind, ())))]
        if len(self._tasks) > 1:
            self._me = f"{resolver.task_type}:{resolver.task_id}"
            threading.Thread(target=self._watch, args=(self._key,), name="distrib_tf-preemption",
                             daemon=True).start()

    def _watch(self, key: str):
        """Reads this fit's step once named (its own key: a later fit has another). The
        coordination service gone (the job ended: a peer left first, by a NaN stop or an
        error) leaves nothing to read, and nothing to say: the main thread says why it ended."""
        try:
            value = context.context().get_config_key_value(key)  # Blocks until set.
            if value != _NONE and key == self._key:
                self._target = int(value)
            context.context().set_config_key_value(f"{key}/read/{self._me}", "1")
        except tf.errors.OpError:
            return

    def on_train_batch_end(self, batch, logs=None):
        step = self.worker_backup.step
        if step % self.worker_backup.steps_per_epoch == 0 and self._end_epoch():
            return  # What comes in the epoch's end is its own (`on_test_begin`, `on_epoch_end`).
        if sigterm.requested() and not self._named:
            self._named = True
            if len(self._tasks) <= 1 or not self._name_step(step + 1):
                self._target = step  # One process, or the other workers are gone: this step.
        if self._target is not None and step >= self._target:
            self.worker_backup.save()
            self.worker_backup.flush()
            raise Preempted(step)

    def _name_step(self, target: int) -> bool:
        """Names `target` unless another worker named one first; False if a worker never read it."""
        if not _set_once(self._key, str(target)):
            return True  # Another worker's step: this one's thread reads it.
        try:
            for task in self._tasks:  # Every worker knows the step before this one goes on.
                context.context().get_config_key_value(f"{self._key}/read/{task}",
                                                       timeout_in_ms=int(self.ack_timeout * 1000))
        except tf.errors.OpError:
            return False
        return True

    @property
    def kept(self) -> int | None:
        """The step every worker's backup holds from an epoch's last step until its end is
        backed up (`None` elsewhere)."""
        return self._kept

    def _end_epoch(self) -> bool:
        """At an epoch's last step: every worker's backup holds the step before its last
        execution (`kept`); a SIGTERM already there (or a step named: a peer's) leaves with it,
        and so does one from here to the epoch's `on_epoch_end` callbacks (`EpochEndBegins`):
        Keras's metrics and validation, whose collectives a peer that left would fail.
        False where no state was taken before that execution."""
        self._kept = self.worker_backup.keep_before_last()
        if self._kept is None:
            return False
        if sigterm.requested() or self._target is not None:
            self.worker_backup.flush()
            raise Preempted(self._kept)
        self._at_once = sigterm.saved(self._kept)
        self._at_once.__enter__()  # pylint: disable=unnecessary-dunder-call
        return True

    def on_test_begin(self, logs=None):
        """Validation inside `fit` after a step that is not an epoch's last (a callback stopped
        the epoch early): every worker backs up the step first, then SIGTERM stops it at once
        (validation runs no training step to agree on). At an epoch's last step `_end_epoch`
        did."""
        if self._in_fit and self._kept is None:  # An `evaluate` of its own is its caller's (`sigterm`).
            self._leave_at_once()
            self.worker_backup.save()
            self._at_once = sigterm.saved(self.worker_backup.step)
            self._at_once.__enter__()  # pylint: disable=unnecessary-dunder-call

    def on_epoch_end(self, epoch, logs=None):
        """Every callback's `on_epoch_end` done on this worker: once every worker's is, the
        epoch's end is backed up; a SIGTERM that came in any worker's, every worker leaves there."""
        kept, self._kept = self._kept, None
        said = self._agree_on_end(epoch, kept)
        if not self.worker_backup.epoch_end_saves:  # (Else it saved before every worker was here.)
            self.worker_backup.save()
        if said:
            self.worker_backup.flush()
            raise Preempted(self.worker_backup.step)

    def _agree_on_end(self, epoch: int, kept: int | None) -> bool:
        """Whether any worker had a SIGTERM by the end of its epoch's end (one process: this one),
        once every worker is there. A worker that left in validation never comes: the others
        leave with `kept` too, as it did."""
        if len(self._tasks) <= 1:
            return sigterm.requested()
        said = f"{self._key}/epoch_end/{epoch}"
        try:
            sigterm.say(f"{said}/{self._me}")
            phases.enter(self.model.distribute_strategy, "epoch_end")
            heard = [context.context().get_config_key_value(f"{said}/{task}") for task in self._tasks]
        except Exception:  # A peer gone: it left in validation (then so does this worker), or died.
            if kept is not None and sigterm.requested():
                sigterm.leave(kept)
            raise
        if "sigterm" not in heard:
            return False
        sigterm.request()  # A peer's, which its watch may deliver here later.
        return True

    def on_test_end(self, logs=None):
        if self._kept is None:
            self._leave_at_once()

    def _leave_at_once(self):
        """Leaves the phase in which a SIGTERM leaves at once; also after a validation that
        SIGTERM ended, whose entry would outlive it."""
        validating, self._at_once = self._at_once, None
        if validating is not None:
            validating.__exit__(None, None, None)

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._leave_at_once()
        if len(self._tasks) > 1:
            _set_once(self._key, _NONE)  # Ends the watching threads of this fit.


class EpochEndBegins(keras.callbacks.Callback):
    """First in `fit`'s list: its `on_epoch_end` is where an epoch's `on_epoch_end` callbacks
    begin, and a SIGTERM from there on is recorded, not acted on at once (`SaveOnPreemption`):
    they run whole, once."""

    def __init__(self, save_on_preemption: SaveOnPreemption):
        super().__init__()
        self.save_on_preemption = save_on_preemption

    def on_epoch_end(self, epoch, logs=None):
        self.save_on_preemption._leave_at_once()  # pylint: disable=protected-access
