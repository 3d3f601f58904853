"""NaN and Inf: every worker stops at the same step, and says which worker saw it.

The check runs inside the training step, in the metric `NonFiniteReplicas`: each replica
sets its flag when its predictions, or (once `StopOnNonFinite` watches them) the model's
weights after the update, hold a NaN or Inf. Keras averages every logged value over the
replicas before a callback sees it, in the same reduction as the loss (under
`sync="step"`, the gradients' own all-reduce: `distrib_tf.keras.step_logs`, where the
weights are checked after the update, locally, since every worker holds the same ones), so
every worker reads the same flag at the same step whatever the sync mode: with `--sync=every:N` the
replicas' weights differ between syncs, and one replica's NaN still stops all of them.
(A NaN does not always reach the loss: a ReLU after a NaN statistic can hide it there
while the gradients carry it into the weights; so the weights are checked too.)
`StopOnNonFinite` then raises `NonFiniteLoss` at that step on all workers, before the
step is backed up, and names the replicas whose predictions held it with one all-gather
of their flags, which every worker enters at that same step: any number of replicas. The
main job also reads that step's input batch again (the data order is a function of the
step) and names the workers whose batch held it.

With `--on_nan=rollback` the main job then restores the last backup every worker holds,
halves the learning rate and goes on, at most `--max_rollbacks` times (the recovery of
tensorflow/models' orbit `RecoveryCondition`); with `--on_nan=stop` it exits with
`distrib_tf.exit_codes.NONFINITE` (65), which the launcher does not retry.

`attach(model)` adds the metric to a compiled model's steps without touching its compile
configuration (what `distrib_tf.Run` does): it sees every output and every input of the
model at once, and `model.keras` then loads with plain Keras. A model compiled with the
metric itself works too; with several outputs Keras logs one per output
(`{output}_nonfinite_replicas`), and any of them stops the run. Without the metric at all,
`StopOnNonFinite` checks the weights itself after each step, in a second function per
step: it still works, slower.

Example:

    >>> attach(model)  # Or: model.compile(..., metrics=["accuracy", NonFiniteReplicas()])
    >>> model.fit(..., callbacks=[StopOnNonFinite(workers=["worker:0", "worker:1"])])
"""

import contextlib
import math
import sys
import weakref

import keras
import numpy as np
import tensorflow as tf

from distrib_tf.keras import resume
from distrib_tf.keras import steps as steps_lib

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


def _all_finite(tensors):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors if t.dtype.is_floating] or [True])


@keras.saving.register_keras_serializable(package="distrib_tf")
class NonFiniteReplicas(keras.metrics.Metric):
    """1 on a replica whose predictions (or watched weights) of the last step hold a NaN or Inf.

    Logged averaged over the replicas: the fraction of replicas that saw one, 0 when none.
    `in_predictions` keeps, per replica, whether its predictions held one.
    """

    def __init__(self, name: str = METRIC, **kwargs):
        super().__init__(name=name, **kwargs)
        self.flags = self.add_variable(shape=(), initializer="zeros", name="flags")
        self.in_predictions = self.add_variable(shape=(), initializer="zeros", name="in_predictions")
        object.__setattr__(self, "_watched", ())  # Past Keras's tracking: not this metric's variables.
        object.__setattr__(self, "_later", False)  # True: the weights are checked after the update, apart.

    def watch(self, variables) -> None:
        """Checks `variables` (the model's weights) too, at every update, from the next trace on."""
        object.__setattr__(self, "_watched", tuple(variables))

    def update_state(self, y_true, y_pred, sample_weight=None):
        in_predictions = tf.logical_not(_all_finite(tf.nest.flatten(y_pred)))
        bad = in_predictions
        if self._watched and not self._later:  # Read after the optimizer's update: the step's own ordering.
            bad = tf.logical_or(bad, tf.logical_not(_all_finite([w.value for w in self._watched])))
        self.in_predictions.assign(tf.cast(in_predictions, self.dtype))
        self.flags.assign(tf.cast(bad, self.dtype))

    def result(self):
        return tf.identity(self.flags)


_ATTACHED = weakref.WeakKeyDictionary()  # Model -> its attached metric: not an attribute, which saving walks.
_BEFORE = weakref.WeakKeyDictionary()  # Model -> what its instance held of `_WRAPPED` before `attach`.
_WRAPPED = ("compute_metrics", "get_metrics_result")
_STEPS = {"train_step": "train", "tf__train_step": "train", "test_step": "test", "tf__test_step": "test"}


def attach(model) -> NonFiniteReplicas:
    """Adds a `NonFiniteReplicas` to the training steps of the compiled `model`, logged as
    `nonfinite_replicas`; returns it (the model's own if it has one already).

    It wraps the model's `compute_metrics` on this instance only and is not in its compile
    configuration, so a saved model names nothing of distrib_tf. Its test steps, and so an
    `evaluate`, log what Keras logs. The step functions are traced again on their next call.
    """
    found = find_metric(model)
    if found is not None:
        return found
    with model.distribute_strategy.scope():  # Per-replica variables, like a compiled metric's.
        metric = NonFiniteReplicas()
    compute, results = model.compute_metrics, model.get_metrics_result
    logged = []  # Not empty once a training step's logs hold the metric (when it is traced).

    def compute_metrics(x, y, y_pred, sample_weight=None):
        logs = compute(x, y, y_pred, sample_weight=sample_weight)
        if _step_being_run() != "train":
            return logs
        metric.update_state(y, y_pred)
        logged.append(True)
        return {**logs, METRIC: metric.result()}

    def get_metrics_result():
        # Keras ends an epoch on the metrics' own results, summed over the replicas, only where
        # their keys are the step's; else on the last step's logs (their per-replica means).
        # So the metric is among them there, and only where the training step logs it.
        caller = sys._getframe(1)  # pylint: disable=protected-access
        if logged and caller.f_code.co_name == "_get_metrics_result_or_logs" and \
                caller.f_back.f_code.co_name == "fit":
            return {**results(), METRIC: metric.result()}
        return results()

    _BEFORE[model] = {name: model.__dict__.get(name) for name in _WRAPPED}  # Set on the instance, if any.
    object.__setattr__(model, "compute_metrics", compute_metrics)  # Past Keras's tracking.
    object.__setattr__(model, "get_metrics_result", get_metrics_result)
    _ATTACHED[model] = metric
    model.train_function = model.test_function = None
    return metric


def _step_being_run() -> str | None:
    """"train" or "test": which of Keras's steps (a model's `train_step`, `test_step`) the
    caller runs inside, the innermost; `None` outside both (a symbolic build)."""
    frame = sys._getframe(2)  # pylint: disable=protected-access
    while frame is not None and frame.f_code.co_name not in _STEPS:
        frame = frame.f_back
    return None if frame is None else _STEPS[frame.f_code.co_name]


def detach(model) -> None:
    """Takes `attach`'s metric off `model` again: its steps log what the user compiled."""
    if _ATTACHED.pop(model, None) is not None:
        for name, own in _BEFORE.pop(model, {}).items():
            if own is None:
                model.__dict__.pop(name, None)
            else:
                object.__setattr__(model, name, own)
        model.train_function = model.test_function = model.predict_function = None


@contextlib.contextmanager
def weights_later(model):
    """Inside, the model's `NonFiniteReplicas` checks the predictions only: its update runs
    before the optimizer's (`distrib_tf.keras.step_logs`), and `check_weights_after_update`
    checks the weights once the update is done."""
    metric = find_metric(model)
    if metric is None:
        yield
        return
    object.__setattr__(metric, "_later", True)
    try:
        yield
    finally:
        object.__setattr__(metric, "_later", False)


def check_weights_after_update(model, logs: dict) -> dict:
    """`logs` (reduced over the replicas) with the check of the watched weights after the
    update added to every `nonfinite_replicas` value and to this replica's flag. Under
    synchronous training the weights are the same on every worker, so is this check."""
    metric = find_metric(model)
    if metric is None or not metric._watched:  # pylint: disable=protected-access
        return logs
    bad = tf.cast(tf.logical_not(_all_finite([w.value for w in metric._watched])),  # pylint: disable=protected-access
                  metric.dtype)
    metric.flags.assign(tf.maximum(metric.flags, bad))
    return {k: tf.maximum(v, tf.cast(bad, v.dtype)) if k.endswith(METRIC) else v for k, v in logs.items()}


def find_metric(model) -> NonFiniteReplicas | None:
    """The model's `NonFiniteReplicas`: attached, or among its compiled metrics; else `None`."""
    if model in _ATTACHED:
        return _ATTACHED[model]
    stack = list(model.metrics)
    while stack:
        metric = stack.pop()
        if isinstance(metric, NonFiniteReplicas):
            return metric
        stack.extend(getattr(metric, "metrics", ()))
    return None


class StopOnNonFinite(keras.callbacks.Callback):
    """Raises `NonFiniteLoss` at the first step whose loss is NaN or Inf.

    Args:
        workers: the task of every replica, in replica order (`["worker:0", ...]`).
        steps_per_epoch: global steps per epoch, to name the epoch.
        steps: the stage's step counter (`distrib_tf.keras.steps`); default: the optimizer's.
        defer: a non-finite loss is left to the user's `keras.callbacks.TerminateOnNaN` (which
            stops or raises as in Keras); non-finite weights under a finite loss still stop here.
    """

    def __init__(self, *, workers: list[str], steps_per_epoch: int, steps: steps_lib.StageSteps | None = None,
                 defer: bool = False):
        super().__init__()
        self.workers, self.steps_per_epoch, self.defer = workers, steps_per_epoch, defer
        self.steps = steps or steps_lib.StageSteps()
        self.step = 0

    def on_train_begin(self, logs=None):
        self.step = self.steps(self.model)
        self._metric = find_metric(self.model)
        weights = self.model.trainable_variables
        if self._metric is not None:
            self._metric.watch(weights)
        self._replicas_nonfinite = _replicas_nonfinite(self.model.distribute_strategy, weights)

    def on_train_batch_end(self, batch, logs=None):
        self.step = self.steps(self.model)
        logs = logs or {}
        # The same values on every worker; one per output where Keras applied it to each. A
        # `train_step` of the model's own that returns logs of its own (keras.io's GANs:
        # `d_loss`, `g_loss`) never updates or logs the metric: the weights are checked here.
        flags = [v for k, v in logs.items() if k.endswith(METRIC)]
        logged = self._metric is not None and bool(flags)
        # Checked here, each replica's weights (they differ between averages under sync="every:N").
        replicas = [] if logged else self._replicas_nonfinite()
        flagged = any(float(v) != 0.0 for v in flags) if logged else any(replicas)
        finite_loss = math.isfinite(float(logs.get("loss", 0.0)))
        if (finite_loss and not flagged) or (self.defer and not finite_loss):
            return  # (Deferring: the user's `TerminateOnNaN` acts on the loss, as in Keras, on every worker alike.)
        culprits, where = [], "predictions"
        if logged:  # Every worker is here at this step: one all-gather.
            strategy = self.model.distribute_strategy
            local = np.array([[float(p.numpy()), float(f.numpy())] for p, f in zip(
                _per_replica(strategy, self._metric.in_predictions),
                _per_replica(strategy, self._metric.flags))]).reshape(-1)
            rows = resume.gather_rows(strategy, local)
            seen = rows[::len(local) // 2].reshape(-1, 2)  # One row per worker: (predictions, any) per replica.
            culprits = [f"replica {r} ({task})" for r, (task, bad) in enumerate(zip(self.workers, seen)) if bad[0]]
            if not culprits:  # Not in the predictions: in the weights after the update.
                culprits = [f"replica {r} ({task})" for r, (task, bad) in enumerate(zip(self.workers, seen))
                            if bad[1]]
                where = "weights"
        elif flagged:
            culprits = [f"replica {r} ({task})" for r, (task, bad) in enumerate(zip(self.workers, replicas)) if bad]
            where = "weights"
        epoch = (self.step - 1) // self.steps_per_epoch + 1
        raise NonFiniteLoss(self.step, epoch, culprits, where)


def _replicas_nonfinite(strategy, weights):
    """A function giving, for each replica in order, whether its copy of `weights` holds a
    NaN or Inf: one all-reduce, entered by every worker, whose answer every worker shares."""
    replicas = strategy.num_replicas_in_sync

    @tf.function
    def flags():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            bad = tf.cast(tf.logical_not(_all_finite([w.value for w in weights])), tf.float32)
            return context.all_reduce("SUM", tf.one_hot(context.replica_id_in_sync_group, replicas) * bad)
        return strategy.run(replica_fn)

    return lambda: [bool(f) for f in strategy.experimental_local_results(flags())[0].numpy()]


def _per_replica(strategy, variable):
    """This worker's replicas' own values of a metric variable. Read across replicas, a
    Keras metric variable is their sum over every worker (a collective)."""
    distributed = getattr(variable, "_value", variable)  # pylint: disable=protected-access
    return strategy.experimental_local_results(distributed)


def name_input_culprits(error: NonFiniteLoss, strategy, replica_tasks, batches) -> None:
    """Reads the failed step's input batch again (`batches` starts there) on every worker;
    names in `error` the tasks whose batch held a NaN or Inf (one all-gather)."""
    x = next(iter(batches))[0]  # One tensor, or a dict or tuple of them (several inputs).
    local = [t.numpy() for each in tf.nest.flatten(x) for t in strategy.experimental_local_results(each)]
    bad = any(not np.isfinite(a).all() for a in local if np.issubdtype(a.dtype, np.inexact))
    rows = resume.gather_rows(strategy, np.array([int(bad)]))
    culprits = sorted({task for task, row in zip(replica_tasks, rows) if row[0]})
    if culprits:
        error.culprits, error.where = culprits, "input batch"
