"""A step whose rows the replicas split unevenly updates the weights as one process would.

Keras averages each replica's loss over that replica's rows, then sums the gradients over
the replicas with a weight `1/R` each. When a step's `n` rows split evenly (`n/R` each),
every row weighs `1/n`, as in one process. When they do not (Keras's last, smaller batch of
an epoch; a batch the replicas do not divide), a row of a replica holding `r_i` rows weighs
`1/(R·r_i)`: the rows of the smaller share count more, and the update differs from one
process's (2 replicas, 11 rows in batches of 4: the weights part in the fourth digit after
two epochs). The logged loss and metrics are not affected: Keras weighs them by rows.

`weigh_rows(model)` scales each replica's loss, before its gradients, by `R·r_i/n`, the
step's rows summed over the replicas by one all-reduce of a scalar: every row weighs `1/n`
again. On an even step the factor is exactly 1, so such steps are unchanged to the bit.
`Run.fit` adds it where its own order can split a step unevenly (`needed`) and every loss
the model compiled averages over its rows (`reductions`: Keras's default; a
summed loss is exact already, Keras scales it by nothing); batches Keras splits itself (a
`tf.data.Dataset`'s) keep Keras's arithmetic. A step of fewer rows than replicas leaves some
with none: Keras's losses give 0 there, but a layer that reduces over its batch
(BatchNormalization) gives NaN, which the run's NaN stop then stops at; `empty_share` finds
such a step so that the run says so before training.

Example:

    >>> weigh_rows(model)  # Until `unweigh(model)`; the step functions are traced again.
"""

import threading

import keras
import tensorflow as tf

_ROWS = threading.local()  # The rows of the replica step being traced (replicas trace in threads of their own).
_WEIGHED = "_distrib_tf_weighed"  # On the model: its own `train_step` and its optimizer's `scale_loss`.


def needed(num_examples: int, global_batch_size: int, replicas: int, *, full_batches: bool) -> bool:
    """Whether the run's order (`distrib_tf.data.order`) ever splits a step unevenly."""
    last = num_examples % global_batch_size
    return replicas > 1 and bool(global_batch_size % replicas or (not full_batches and last % replicas))


def empty_share(num_examples: int, global_batch_size: int, replicas: int, *, full_batches: bool) -> int:
    """The rows of a step that holds fewer than the replicas (some get none): every step's where
    the batch is smaller than that, else the epoch's last step's; 0 where no step does."""
    if global_batch_size < replicas:
        return global_batch_size
    last = 0 if full_batches else num_examples % global_batch_size
    return last if last < replicas else 0


MEANS = {"sum_over_batch_size", "mean"}  # Keras's default, for a loss given by name or function too.


def reductions(model) -> set:
    """The reductions of the losses `model` compiled: all in `MEANS` is what `weigh_rows`
    makes exact; all `"sum"` is exact without it (Keras scales a sum by nothing)."""
    return {getattr(loss, "reduction", "sum_over_batch_size")
            for loss in keras.tree.flatten(model.loss) if loss is not None}


def weigh_rows(model) -> None:
    """Makes each replica's gradients of `model` weigh every row of a step `1/n` (module doc)."""
    if _WEIGHED in model.__dict__:
        return
    optimizer, train_step = model.optimizer, model.train_step
    scale_loss = optimizer.scale_loss

    def weighed_train_step(data):
        _ROWS.rows = tf.shape(next(t for t in tf.nest.flatten(data) if t is not None))[0]  # Keras's count.
        try:
            return train_step(data)
        finally:
            _ROWS.rows = None

    def weighed_scale_loss(loss):
        rows, context = getattr(_ROWS, "rows", None), tf.distribute.get_replica_context()
        if rows is None or context is None:
            return scale_loss(loss)
        rows = tf.cast(rows, loss.dtype)
        share = context.num_replicas_in_sync * rows / context.all_reduce("SUM", rows)
        return scale_loss(loss * share)

    own = (model.__dict__.get("train_step"), optimizer.__dict__.get("scale_loss"))  # A script's own, if any.
    object.__setattr__(model, "train_step", weighed_train_step)  # Past Keras's tracking, this instance only.
    object.__setattr__(optimizer, "scale_loss", weighed_scale_loss)
    object.__setattr__(model, _WEIGHED, (optimizer, own))
    model.train_function = None


def unweigh(model) -> None:
    """Takes `weigh_rows` off `model` again (a `train_step` or `scale_loss` set on the instance
    before it is put back)."""
    weighed = model.__dict__.pop(_WEIGHED, None)
    if weighed is not None:
        optimizer, (train_step, scale_loss) = weighed
        for owner, name, own in ((model, "train_step", train_step), (optimizer, "scale_loss", scale_loss)):
            if own is None:
                owner.__dict__.pop(name, None)
            else:
                object.__setattr__(owner, name, own)
        model.train_function = None
