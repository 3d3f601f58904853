"""A rollback's lower learning rate under a `LearningRateSchedule`: the user's schedule, scaled.

An optimizer made with a schedule has no learning rate to assign (Keras raises `TypeError`),
so a rollback replaces the schedule with `Scaled(schedule, 0.5)`, which keeps its shape and
its step count. Saving puts the user's own schedule back for the moment of the save, so
that `model.keras` names nothing of distrib_tf.

Example:

    >>> halved = Scaled.halving(keras.optimizers.schedules.CosineDecay(1e-3, 1000))
    >>> float(halved(0))
    0.0005
"""

import contextlib

import keras


@keras.saving.register_keras_serializable(package="distrib_tf")
class Scaled(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule(step) * factor`."""

    def __init__(self, schedule, factor: float):
        self.schedule, self.factor = schedule, float(factor)

    @classmethod
    def halving(cls, schedule) -> "Scaled":
        """Half of `schedule`, which may be a `Scaled` already (then a quarter of its own)."""
        if isinstance(schedule, cls):
            return cls(schedule.schedule, schedule.factor / 2)
        return cls(schedule, 0.5)

    def __call__(self, step):
        return self.schedule(step) * self.factor

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule), "factor": self.factor}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config["schedule"]), config["factor"])


def schedule_of(optimizer):
    """The optimizer's `LearningRateSchedule` (a copy, from its configuration), else `None`."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # A LossScaleOptimizer's own.
    config = inner.get_config().get("learning_rate")
    if not isinstance(config, dict):
        return None
    schedule = keras.optimizers.schedules.deserialize(config)
    return schedule if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule) else None


@contextlib.contextmanager
def plain(optimizer, schedule):
    """Inside, the optimizer holds `schedule` (the user's; `None`: leave it as it is)."""
    if schedule is None:
        yield
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    current = schedule_of(inner)
    inner.learning_rate = schedule
    try:
        yield
    finally:
        inner.learning_rate = current


def halve(run, model) -> bool:
    """A rollback under a schedule: the optimizer's schedule halved (`run._schedule` keeps the
    user's own for saving); False when the optimizer has a plain learning rate (a variable of
    the optimizer: the caller assigns it, and the backups hold it)."""
    schedule = schedule_of(model.optimizer)
    if schedule is None:
        return False
    if run._schedule is None:  # pylint: disable=protected-access
        run._schedule = schedule  # pylint: disable=protected-access
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    inner.learning_rate = Scaled.halving(schedule)
    model.train_function = model.test_function = None  # Traced into the step: traced again with it.
    return True


def redo(run, model, rollbacks: list) -> list:
    """On a resume: the schedule halved once for each of the backup's `rollbacks` (a plain
    learning rate came back with the optimizer's variables). Returns them, to go on counting."""
    for _ in rollbacks if schedule_of(model.optimizer) is not None else ():
        halve(run, model)
    return list(rollbacks)
