"""The one step counter every guarantee reads: global steps done in a `fit` stage.

Keras's `optimizer.iterations` counts every step the optimizer ever took (with
`gradient_accumulation_steps=k`, one per k batches: the count here is of batches,
`compat.batches_taken`): a second `fit` of a compiled model ("train more") goes on from
the first's count, and so does one with `initial_epoch`. And `on_train_batch_end` runs
once an execution, not once a step (`compile(steps_per_execution=4)`). Counting batch
ends, or reading `iterations` as the stage's step, so backs up, syncs and names the wrong
step. `StageSteps` is a stage's own count: the optimizer's batches since the stage's step
0, read where it is needed. A `train_step` that applies optimizers of its own (keras.io's
GANs) never moves `model.optimizer`; `BatchSteps`, the count a `distrib_tf.Run` owns, does
not ask any optimizer: it counts the batches Keras's train function took, at each
execution's end.

Example:

    >>> steps = StageSteps(model.optimizer, done=0)  # At the stage's start (or its resumed step).
    >>> model.fit(x, y, epochs=2)                     # 8 steps of its own, whatever came before.
    >>> steps()
    8
"""

import keras

from distrib_tf.keras import compat


def iterations(optimizer) -> int:
    """The optimizer's own count of the batches it took: its `iterations`, or with
    `gradient_accumulation_steps=k` the count that `iterations` divides by k
    (`compat.batches_taken`)."""
    return int(keras.ops.convert_to_numpy(compat.batches_taken(optimizer)))


class StageSteps:
    """Global steps done in a stage: `optimizer.iterations` minus what it held at the stage's
    step 0. Restoring a backup restores `iterations` with the weights, so the count stays the
    stage's own after a resume or a rollback.

    Args:
        optimizer: the model's; `None`: the model's that a callback passes to the call.
        done: the stage's steps already done (a resumed stage's step).
    """

    def __init__(self, optimizer=None, done: int = 0):
        self.optimizer = optimizer
        self.base = 0 if optimizer is None else iterations(optimizer) - done  # Alone: the optimizer's count.

    def __call__(self, model=None) -> int:
        return iterations(self.optimizer if self.optimizer is not None else model.optimizer) - self.base


def crossed(before: int, now: int, every: int) -> bool:
    """Whether a multiple of `every` lies in `(before, now]`: a step where something is due,
    passed by one execution of several steps."""
    return every > 0 and now // every > before // every


class BatchSteps(keras.callbacks.Callback):
    """Global steps done in a stage, counted by the run itself: the batches Keras's train
    function took, whichever optimizers the `train_step` applies (none of them is read).
    First in `fit`'s list: every callback after it reads the step at the execution's end.

    Keras names each execution by the index of its last batch in the epoch (`end_step`);
    an epoch's last execution may take fewer (its data ends there), so the count stops at the
    epoch's end. The stage says where each of its Keras fits begins (`begin`): its step 0,
    a resumed step, the step a rollback went back to.

    Args:
        steps_per_epoch: the stage's global steps per epoch.
        done: the stage's steps already done (a resumed stage's step).
    """

    def __init__(self, steps_per_epoch: int, done: int = 0):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.done = self.epoch_began = done

    def begin(self, done: int) -> None:
        """The next Keras fit starts at the stage's step `done`."""
        self.done = self.epoch_began = done

    def __call__(self, model=None) -> int:
        return self.done

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_began = self.done

    def on_train_batch_end(self, batch, logs=None):
        epoch_end = (self.epoch_began // self.steps_per_epoch + 1) * self.steps_per_epoch
        self.done = min(self.epoch_began + batch + 1, epoch_end)
