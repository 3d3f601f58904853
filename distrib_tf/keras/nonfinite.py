"""NaN and Inf: every worker stops at the same step, and says which worker saw it.

Keras averages each step's loss over every replica before a callback sees it, so a
non-finite loss on one worker is non-finite in every worker's logs at the same step; a
non-finite gradient makes the weights non-finite, and they are the same on every worker.
After every step, `StopOnNonFinite` checks both (the loss, and every trainable weight in
one compiled reduction) and raises `NonFiniteLoss` at that step on all workers, before
the step is backed up, so no worker is left waiting in a collective. (A NaN does not
always reach the loss: a ReLU after a NaN batch statistic can hide it there while the
gradients carry it into the weights.) The `NonFiniteReplicas` metric names
the culprit: each replica reports `2**r` when its own predictions hold a NaN or Inf, and
the average over replicas that Keras logs encodes which ones did. A NaN that reaches a
synchronized BatchNormalization reaches every replica's predictions, so the main job
also reads that step's input batch again (the data order is a function of the step) and
names the workers whose batch held it.

With `--on_nan=rollback` the main job then restores the last backup every worker holds,
halves the learning rate and goes on, at most `--max_rollbacks` times (the recovery of
tensorflow/models' orbit `RecoveryCondition`); with `--on_nan=stop` it exits with
`distrib_tf.exit_codes.NONFINITE` (65), which the launcher does not retry.

Example:

    >>> model.compile(..., metrics=["accuracy", NonFiniteReplicas()])
    >>> model.fit(..., callbacks=[StopOnNonFinite(workers=["worker:0", "worker:1"])])
"""

import math

import keras
import numpy as np
import tensorflow as tf

from distrib_tf.keras import backup

METRIC = "nonfinite_replicas"


class NonFiniteLoss(Exception):
    """The loss became NaN or Inf at `step`; every worker raises it at the same step.

    `culprits` names where it was seen: the tasks whose input batch held a NaN or Inf
    (filled in by the main job, which can read any step's batch again), else the replicas
    whose predictions did.
    """

    def __init__(self, step: int, epoch: int, culprits: list[str], where: str = "predictions"):
        super().__init__()
        self.step, self.epoch, self.culprits, self.where = step, epoch, culprits, where

    def __str__(self):
        who = (f"in the {self.where} of {', '.join(self.culprits)}" if self.culprits
               else "in no replica's predictions (the loss or the labels)")
        return (f"Non-finite loss or gradient at step {self.step} (epoch {self.epoch}); NaN or Inf "
                f"first seen {who}.")


@keras.saving.register_keras_serializable(package="distrib_tf")
class NonFiniteReplicas(keras.metrics.Metric):
    """`2**r` on replica r when its predictions of the last batch hold a NaN or Inf."""

    def __init__(self, name: str = METRIC, **kwargs):
        super().__init__(name=name, **kwargs)
        self.flags = self.add_variable(shape=(), initializer="zeros", name="flags")

    def update_state(self, y_true, y_pred, sample_weight=None):
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group if context is not None else 0
        bad = tf.logical_not(tf.reduce_all(tf.math.is_finite(tf.cast(y_pred, tf.float32))))
        self.flags.assign(tf.cast(bad, tf.float32) * tf.pow(2.0, tf.cast(replica, tf.float32)))

    def result(self):
        return tf.identity(self.flags)


class StopOnNonFinite(keras.callbacks.Callback):
    """Raises `NonFiniteLoss` at the first step whose loss is NaN or Inf.

    Args:
        workers: the task of every replica, in replica order (`["worker:0", ...]`).
        steps_per_epoch: global steps per epoch, to name the epoch.
    """

    def __init__(self, *, workers: list[str], steps_per_epoch: int):
        super().__init__()
        self.workers, self.steps_per_epoch = workers, steps_per_epoch
        self.step = 0

    def on_train_begin(self, logs=None):
        self.step = int(self.model.optimizer.iterations.numpy())
        weights = self.model.trainable_variables
        self._weights_finite = tf.function(
            lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(w)) for w in weights]))

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        loss = float((logs or {}).get("loss", 0.0))
        if math.isfinite(loss) and bool(self._weights_finite()):
            return
        mask = round(float(logs.get(METRIC, 0.0)) * len(self.workers))
        culprits = [f"replica {r} ({task})" for r, task in enumerate(self.workers) if mask >> r & 1]
        epoch = (self.step - 1) // self.steps_per_epoch + 1
        raise NonFiniteLoss(self.step, epoch, culprits)


def name_input_culprits(error: NonFiniteLoss, strategy, replica_tasks, batches) -> None:
    """Reads the failed step's input batch again (`batches` starts there) on every worker;
    names in `error` the tasks whose batch held a NaN or Inf (one all-gather)."""
    x = next(iter(batches))[0]
    bad = any(not np.isfinite(t.numpy()).all() for t in strategy.experimental_local_results(x))
    rows = backup.gather_rows(strategy, np.array([int(bad)]))
    culprits = sorted({task for task, row in zip(replica_tasks, rows) if row[0]})
    if culprits:
        error.culprits, error.where = culprits, "input batch"
