"""Preemption that loses no step: SIGTERM, one agreed step, a backup on every worker, exit 75.

Inside a `fit` (`sigterm.guarded()`) a SIGTERM only records that it came. Between training
batches, `SaveOnPreemption` then has every worker agree on the next step through the
coordination service, back it up and raise `Preempted`; between preemptions it costs nothing
but a flag read per step. What a SIGTERM does outside the training batches (start-up,
validation, the script's own code after `fit`, the outputs) is `distrib_tf.keras.sigterm`'s;
which exit code a run leaves with, in every case, is `distrib_tf.run.ending`'s. The main
job then exits with `distrib_tf.exit_codes.PREEMPTED` (75), which the launcher forwards;
started again, the job resumes at that step (`distrib_tf.keras.backup`): no step is lost.

Example, for a Keras user's own `fit`:

    >>> strategy = distrib_tf.make_strategy()
    >>> sigterm.install()  # After the strategy: making one takes SIGTERM's handler.
    >>> backup = WorkerBackup(...)
    >>> with sigterm.guarded():
    ...     model.fit(..., callbacks=[backup, SaveOnPreemption(backup)])
"""

import os
import threading

import keras
import tensorflow as tf
from tensorflow.python.eager import context  # The coordination service's key-value store.

from distrib_tf.keras import sigterm
from distrib_tf.keras.sigterm import GRACE_ENV
from distrib_tf.keras.sigterm import Preempted

__all__ = ["GRACE_ENV", "Preempted", "SaveOnPreemption", "fits"]

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

    Args:
        worker_backup: the `distrib_tf.keras.worker_backup.WorkerBackup` of this worker, which
            must come before this callback in `fit`'s list (it counts the steps).
        ack_timeout: seconds to wait for the other workers to read the step; by default a
            quarter of the seconds between SIGTERM and SIGKILL that the launcher gives its
            tasks (`DISTRIB_TF_GRACE_SECONDS`), else 120: the step and the backup must
            still fit in that grace after a worker that never answers.
    """

    def __init__(self, worker_backup, *, ack_timeout: float | None = None):
        super().__init__()
        if ack_timeout is None:
            grace = os.environ.get(GRACE_ENV)
            ack_timeout = float(grace) / 4 if grace else 120.0
        self.worker_backup, self.ack_timeout = worker_backup, ack_timeout
        self._in_fit, self._validating = False, None

    def on_train_begin(self, logs=None):
        _fits[0] += 1  # A key per Keras fit in the process, alike on every worker (rollbacks, stages).
        self._leave_validation()
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
        """Reads this fit's step once named (its own key: a later fit has another)."""
        value = context.context().get_config_key_value(key)  # Blocks until set.
        if value != _NONE and key == self._key:
            self._target = int(value)
        context.context().set_config_key_value(f"{key}/read/{self._me}", "1")

    def on_train_batch_end(self, batch, logs=None):
        step = self.worker_backup.step
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

    def on_test_begin(self, logs=None):
        """Validation inside `fit`: every worker backs up the step first, then SIGTERM stops
        it at once (validation runs no training step to agree on)."""
        self._leave_validation()
        if self._in_fit:  # An `evaluate` of its own is its caller's (`sigterm`).
            self.worker_backup.save()
            self._validating = sigterm.saved(self.worker_backup.step)
            self._validating.__enter__()  # pylint: disable=unnecessary-dunder-call

    def on_test_end(self, logs=None):
        self._leave_validation()

    def _leave_validation(self):
        """Also after a validation that SIGTERM ended: its entry would outlive it."""
        validating, self._validating = self._validating, None
        if validating is not None:
            validating.__exit__(None, None, None)

    def on_train_end(self, logs=None):
        self._in_fit = False
        if len(self._tasks) > 1:
            _set_once(self._key, _NONE)  # Ends the watching threads of this fit.
