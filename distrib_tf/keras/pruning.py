"""A sweep's pruning, on every worker at one step: the end of the epoch the sweep judged.

In a trial whose sweep prunes (`distrib_tf.trial.prunes()`), `PruneAtEpochEnd` runs at
every epoch's end of every `fit` (each numbering its epochs from 1), after the epoch's
`epoch` event went out (`distrib_tf.keras.progress`) and its backup was taken
(`distrib_tf.keras.worker_backup.WorkerBackup`). The chief waits for the sweep's word on that
fit's epoch (`distrib_tf.trial.decision`, which the sweep writes into the study once it
has reported the epoch's metric to its Optuna pruner) and names it in the coordination
service's key-value store; every other worker reads it there. On `prune`, each waits for
its backup of that step to be on the disk and raises `Pruned`: the run exits with
`distrib_tf.exit_codes.PRUNED` (3) and one line, and its state stays, so that the same
trial started again goes on from that step.

A SIGTERM while the chief waits ends the wait (`go`): the preemption then agrees on a
step as usual. Outside a pruning sweep the callback is not there at all.
"""

import keras
import tensorflow as tf
from tensorflow.python.eager import context  # The coordination service's key-value store.

from distrib_tf import exit_codes
from distrib_tf import trial
from distrib_tf.keras import preemption
from distrib_tf.keras import sigterm

DECISION_SECONDS = 120.0  # The longest the chief waits for the sweep's word on an epoch.


class Pruned(preemption.Preempted):
    """The sweep pruned this trial after `epoch`: every worker backed up `step` and stops."""

    def __init__(self, step: int, epoch: int):
        super().__init__(step)
        self.args = (f"pruned by the sweep after epoch {epoch}: every worker backed up step {step}",)
        self.epoch = epoch

    def describe(self, task: str) -> str:
        return (f"{task} pruned by the sweep after epoch {self.epoch}: backed up step {self.step} like every "
                f"worker; the same trial started again goes on from there (exit code {exit_codes.PRUNED})")


class PruneAtEpochEnd(keras.callbacks.Callback):
    """Stops every worker at the end of an epoch the sweep prunes (see the module).

    Args:
        worker_backup: this worker's `WorkerBackup`, before this callback in `fit`'s list.
        is_chief: whether this worker reads the sweep's word (the others read the chief's).
        fit: which `fit` of the script this is (1-based): the sweep's words are per fit.
        timeout: seconds the chief waits for the word before going on.
    """

    def __init__(self, worker_backup, *, is_chief: bool, fit: int = 1, timeout: float = DECISION_SECONDS):
        super().__init__()
        self.worker_backup, self.is_chief, self.timeout, self.fit = worker_backup, is_chief, timeout, fit

    def on_train_begin(self, logs=None):
        resolver = getattr(self.model.distribute_strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        self._several = sum(len(spec.get(kind, ())) for kind in ("chief", "worker")) > 1
        self._fit = preemption.fits()  # Keys of their own for each fit (SaveOnPreemption counted it).

    def on_epoch_end(self, epoch, logs=None):
        key = f"distrib_tf/prune/{self._fit}/{epoch + 1}"
        if self.is_chief:
            word = trial.decision(epoch + 1, fit=self.fit, timeout=self.timeout, stop_waiting=sigterm.requested)
            if self._several:
                _set(key, word)
        else:
            word = _wait_for(key)
        if word == "prune":
            self.worker_backup.flush()  # The epoch's backup (taken before this callback) on the disk.
            raise Pruned(self.worker_backup.step, epoch + 1)


def _set(key: str, value: str) -> None:
    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:  # The epoch again after a rollback: its word stands.
        pass


def _wait_for(key: str) -> str:
    """The chief's word, in waits of a second: the signal handlers run between them."""
    while True:
        try:
            return context.context().get_config_key_value(key, timeout_in_ms=1000)
        except tf.errors.DeadlineExceededError:
            continue

