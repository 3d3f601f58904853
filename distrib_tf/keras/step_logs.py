"""A training step's logs travel in its gradients' all-reduce: one collective a step.

Keras's `train_step` all-reduces the gradients inside `optimizer.apply_gradients`, then
updates the metrics and returns the logs, which `fit` averages over the replicas in a
second collective (`distrib_tf.keras.compat`, fix 2, packs them into one). Each of the two
is a round trip between the workers. But the metrics need only the step's data and
predictions, which exist before the gradients are reduced; so `carry(model)` updates them
there, and each replica's logs, divided by the replica count, join the gradients' pack as
one more vector (in the gradients' type: float32, or float64 for a float64 model) and come
back summed, that is averaged, as `fit` would have averaged them. The step returns them,
and `fit` takes them as they are. The logs are the same values as before up to the
rounding of that sum.

The NaN stop stays agreed at the same step on every worker: the flag of the predictions
travels with the logs, and the check of the weights after the update needs no collective,
since under `sync="step"` every worker applies the same reduced gradients to the same
weights and so gets the same answer (`distrib_tf.keras.nonfinite`).

The step keeps its second collective (the arithmetic unchanged) where nothing can ride:
periodic sync (most steps all-reduce no gradients), compressed gradients (bfloat16 would
round the logs), a loss-scaling optimizer or gradient accumulation (the all-reduce sits in
a branch), a log that is not a float scalar, or a `train_step` of the user's own that
calls no `compute_loss`.

Example:

    >>> carry(model)  # What `distrib_tf.Run.fit` does under `sync="step"` on several workers.
"""

import inspect
import threading
import weakref

import keras
import tensorflow as tf

from distrib_tf.keras import compat_fixes
from distrib_tf.keras import local_sgd
from distrib_tf.keras import nonfinite

_CARRIED = weakref.WeakKeyDictionary()  # Model -> what its instance held of `_WRAPPED` before `carry`.
_WRAPPED = ("compute_loss", "compute_metrics")


class _Rider(threading.local):
    """What one traced training step hands from `compute_loss` to the gradients' all-reduce
    and from there to `compute_metrics`: trace-time values, reset at each step's loss. Its
    own for each thread: replicas of one worker are traced in threads of their own."""

    def __init__(self, model, compute_metrics):
        super().__init__()
        self.model, self.compute_metrics = model, compute_metrics
        self.step = self.logs = self.reduced = None

    def begin(self, x, y, y_pred, sample_weight, training):
        self.step = (x, y, y_pred, sample_weight) if training else None
        self.logs = self.reduced = None
        compat_fixes.mark_logs_reduced(self.model.distribute_strategy, False)

    def board(self, grads_and_vars):
        if self.step is None:
            return None
        x, y, y_pred, sample_weight = self.step
        self.step = None
        types = {g.dtype for g, _ in grads_and_vars if g is not None}
        with nonfinite.weights_later(self.model):  # Their check comes after the update.
            self.logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if len(types) != 1 or not all(tf.is_tensor(v) and v.shape.rank == 0 and v.dtype.is_floating
                                      for v in self.logs.values()):
            return None  # fit reduces them, as Keras does.
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        dtype = types.pop()
        return tf.stack([tf.cast(v, dtype) for v in self.logs.values()]) / replicas

    def alight(self, total):
        self.reduced = {k: tf.cast(v, self.logs[k].dtype) for k, v in zip(self.logs, tf.unstack(total))}

    def end(self, x, y, y_pred, sample_weight):
        logs, reduced = self.logs, self.reduced
        self.step = self.logs = self.reduced = None
        if logs is None:  # Nothing boarded: the step as Keras has it.
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if reduced is None:
            return logs
        compat_fixes.mark_logs_reduced(self.model.distribute_strategy, True)
        return nonfinite.check_weights_after_update(self.model, reduced)


def carry(model) -> bool:
    """Makes the logs of `model`'s training steps travel in its gradients' all-reduce, from
    the next trace on; returns whether they can (see the module docstring). Idempotent."""
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or getattr(
            optimizer, "gradient_accumulation_steps", None):
        return False
    if model in _CARRIED:
        return True
    rider = _Rider(model, model.compute_metrics)
    if not local_sgd.carry_with_gradients(optimizer, rider):
        return False
    compute_loss = model.compute_loss
    # Keras passes `training` only to a `compute_loss` that takes it (`Trainer._compute_loss`;
    # keras.io's `Distiller` has none), and so does this one: it gets what it gets in Keras.
    takes_training = "training" in inspect.signature(compute_loss).parameters

    def compute_loss_(x=None, y=None, y_pred=None, sample_weight=None, training=True, **kwargs):
        rider.begin(x, y, y_pred, sample_weight, training and tf.distribute.in_cross_replica_context() is False)
        if takes_training:
            kwargs["training"] = training
        return compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, **kwargs)

    def compute_metrics(x, y, y_pred, sample_weight=None):
        return rider.end(x, y, y_pred, sample_weight)

    before = {name: model.__dict__.get(name) for name in _WRAPPED}  # Set on the instance before, if any.
    object.__setattr__(model, "compute_loss", compute_loss_)  # Past Keras's tracking, this instance only.
    object.__setattr__(model, "compute_metrics", compute_metrics)
    _CARRIED[model] = before
    model.train_function = model.test_function = None
    return True


def release(model) -> None:
    """Undoes `carry(model)`: its steps compute their logs as Keras does."""
    before = _CARRIED.pop(model, None)
    if before is None:
        return
    for name, own in before.items():  # Keras's method again, or what the instance held (`nonfinite.attach`'s).
        if own is None:
            model.__dict__.pop(name, None)
        else:
            object.__setattr__(model, name, own)
    model.train_function = model.test_function = None
