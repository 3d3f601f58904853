"""One EMA swap a stage: Keras's `fit` ends by writing the optimizer's moving averages into
the model's weights (`use_ema=True`: `finalize_variable_values`, after the last epoch's end and
before `on_train_end`). A stage that runs several Keras fits (a resumed partial epoch, then
the rest; one fit an epoch under `steps_per_execution`) would swap at each one's end and train
on from the averages; `KeepWeightsUntilLast` puts the trained weights back after every fit but
the stage's last, so that the stage swaps once, where plain Keras's `fit` does.

Example (the stage's callbacks, in this order):

    >>> keep = KeepWeightsUntilLast(lambda: this_fit_is_the_stages_last)
    >>> model.fit(..., callbacks=[keep.putting_back, *others, keep])
"""

import keras
import tensorflow as tf


def uses_ema(optimizer) -> bool:
    """Whether Keras's `fit` swaps `optimizer`'s moving averages in at its end (a
    LossScaleOptimizer's: its inner optimizer's)."""
    return bool(getattr(getattr(optimizer, "inner_optimizer", optimizer), "use_ema", False))


class KeepWeightsUntilLast(keras.callbacks.Callback):
    """Takes the trained weights at each epoch's end (last among the callbacks: after every
    other's `on_epoch_end`) and, unless `last()` or a callback stopped the training, writes
    them back at the fit's `on_train_end` (`putting_back`, first among the callbacks), undoing
    the EMA swap Keras made in between. Each replica's own values (periodic sync's differ).

    Args:
        last: whether the current Keras fit is the stage's last.
    """

    def __init__(self, last):
        super().__init__()
        self.last = last
        self.kept = None  # (variable, value) of each replica's part, between an epoch's end and the fit's.
        self.putting_back = _PutBack(self)

    def on_train_begin(self, logs=None):
        self.kept = None

    def on_epoch_begin(self, epoch, logs=None):
        self.kept = None  # Another epoch in this fit: the last epoch's end takes them.

    def on_epoch_end(self, epoch, logs=None):
        self.kept = None
        if self.last() or not uses_ema(self.model.optimizer):
            return
        strategy = self.model.distribute_strategy
        parts = [part for v in self.model.trainable_weights for part in strategy.experimental_local_results(v.value)]
        self.kept = [(part, tf.convert_to_tensor(part)) for part in parts]  # The values now, not copied.


class _PutBack(keras.callbacks.Callback):
    """`KeepWeightsUntilLast`'s other half, first at `on_train_end`."""

    def __init__(self, keeper: KeepWeightsUntilLast):
        super().__init__()
        self.keeper = keeper

    def on_train_end(self, logs=None):
        kept, self.keeper.kept = self.keeper.kept, None
        if kept is None or self.model.stop_training or self.keeper.last():  # Stopped: this fit ends the stage.
            return
        for part, value in kept:
            part.assign(value)
