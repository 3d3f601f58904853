"""Preemption that loses no step: SIGTERM, one agreed step, a backup on every worker, exit 75.

Clusters take machines back with a SIGTERM first (Slurm before a preemption or the end of
a time limit, Kubernetes before an eviction). `install_sigterm_handler()` makes SIGTERM
only record that it came. After every training step, `SaveOnPreemption` sums that flag
over every replica (one 4-byte all-reduce per step, in a `tf.function` traced once): when
any worker was told,
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
import tensorflow as tf

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

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy

        @tf.function
        def told(flag):
            def replica_fn():  # The flag, read on this replica's device, summed over all.
                return tf.distribute.get_replica_context().all_reduce("SUM", tf.identity(flag))
            return strategy.run(replica_fn)

        self._told = lambda flag: strategy.experimental_local_results(told(tf.constant(flag)))[0]

    def on_train_batch_end(self, batch, logs=None):
        if float(self._told(float(_requested))) > 0:
            self.worker_backup.save()
            raise Preempted(self.worker_backup.step)
