"""The one step counter every guarantee reads: global steps done in a `fit` stage.

Keras's `optimizer.iterations` counts every step the optimizer ever took: a second `fit`
of a compiled model ("train more") goes on from the first's count, and so does one with
`initial_epoch`. And `on_train_batch_end` runs once an execution, not once a step
(`compile(steps_per_execution=4)`). Counting batch ends, or reading `iterations` as the
stage's step, so backs up, syncs and names the wrong step. `StageSteps` is the stage's own
count: the optimizer's iterations since the stage's step 0, read where it is needed.

Example:

    >>> steps = StageSteps(model.optimizer, done=0)  # At the stage's start (or its resumed step).
    >>> model.fit(x, y, epochs=2)                     # 8 steps of its own, whatever came before.
    >>> steps()
    8
"""

import keras


def iterations(optimizer) -> int:
    """The optimizer's own count of the steps it took."""
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


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
