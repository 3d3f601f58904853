"""Preemption that loses no step: SIGTERM, one agreed step, a backup on every worker, exit 75.

Clusters take machines back with a SIGTERM first (Slurm before a preemption or the end of
a time limit, Kubernetes before an eviction). `install_sigterm_handler()` makes SIGTERM
only record that it came. After every training step, `SaveOnPreemption` all-gathers
that flag from every worker (one tiny collective per step): when any worker was told,
all of them back up the same step and raise `Preempted`. The main job then exits with
`EXIT_PREEMPTED` (75), which the launcher forwards; started again, the job resumes at
that step (`distrib_tf.backup`): no step is lost.

Example, for a Keras user's own `fit`:

    >>> install_sigterm_handler()
    >>> backup = WorkerBackup(...)
    >>> model.fit(..., callbacks=[backup, SaveOnPreemption(backup)])
"""

import signal

import keras
import numpy as np

from distrib_tf import backup

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the state is saved; start the job again to resume.

_requested = False


class Preempted(Exception):
    """Every worker backed up `step` because one of them received SIGTERM."""

    def __init__(self, step: int):
        super().__init__(f"preempted: every worker backed up step {step}")
        self.step = step


def install_sigterm_handler() -> None:
    """SIGTERM then only records that a preemption is coming (main thread only)."""
    def record(signum, frame):
        global _requested
        _requested = True

    signal.signal(signal.SIGTERM, record)


def request() -> None:
    """Asks for a preemption save at the next step, as SIGTERM does."""
    global _requested
    _requested = True


class SaveOnPreemption(keras.callbacks.Callback):
    """After every step, agrees with every worker whether to save and stop.

    Args:
        worker_backup: the `distrib_tf.backup.WorkerBackup` of this worker, which
            must come before this callback in `fit`'s list (it counts the steps).
    """

    def __init__(self, worker_backup):
        super().__init__()
        self.worker_backup = worker_backup

    def on_train_batch_end(self, batch, logs=None):
        rows = backup.gather_rows(self.model.distribute_strategy, np.array([int(_requested)]))
        if rows.any():
            self.worker_backup.save()
            raise Preempted(self.worker_backup.step)
