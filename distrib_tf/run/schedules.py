"""A rollback's lower learning rate under a `LearningRateSchedule`: the user's schedule, halved.

An optimizer made with a schedule has no learning rate to assign (Keras raises `TypeError`),
so a rollback replaces the schedule with a halved one that keeps its shape and its step
count: one of Keras's own schedules is made again from its configuration with its rates
halved (`halving`; a plain Keras `model.save` writes it and plain Keras loads it); any other
is wrapped in `Scaled(schedule, 0.5)` during `fit`, and after it (`settle`) the optimizer
holds the user's own again, which is said in one line.

Example:

    >>> halved = halving(keras.optimizers.schedules.CosineDecay(1e-3, 1000))
    >>> type(halved).__name__, float(halved(0))
    ('CosineDecay', 0.0005)
"""

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


# Keras's own schedules, and the entries of their configuration that are rates (the others are
# steps, factors or fractions of those rates): half of each is half of the schedule at every step.
_RATES = {
    "ExponentialDecay": ("initial_learning_rate",),
    "PiecewiseConstantDecay": ("values",),
    "PolynomialDecay": ("initial_learning_rate", "end_learning_rate"),
    "InverseTimeDecay": ("initial_learning_rate",),
    "CosineDecay": ("initial_learning_rate", "warmup_target"),
    "CosineDecayRestarts": ("initial_learning_rate",),
}


def halving(schedule):
    """Half of `schedule`: one of Keras's own schedules (not a subclass) with its rates halved,
    else `Scaled.halving(schedule)`."""
    name = type(schedule).__name__
    if name not in _RATES or type(schedule) is not getattr(keras.optimizers.schedules, name, None):
        return Scaled.halving(schedule)
    config = schedule.get_config()
    for key in _RATES[name]:
        value = config.get(key)
        if value is not None:
            config[key] = [v / 2 for v in value] if isinstance(value, (list, tuple)) else value / 2
    return type(schedule).from_config(config)


def halve(model) -> bool:
    """A rollback under a schedule: the optimizer's schedule halved (`halving`); False when
    the optimizer has a plain learning rate (a variable of the optimizer: the caller assigns
    it, and the backups hold it)."""
    schedule = schedule_of(model.optimizer)
    if schedule is None:
        return False
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    inner.learning_rate = halving(schedule)
    model.train_function = model.test_function = None  # Traced into the step: traced again with it.
    return True


def redo(model, rollbacks: list) -> list:
    """On a resume: the schedule halved once for each of the backup's `rollbacks` (a plain
    learning rate came back with the optimizer's variables). Returns them, to go on counting."""
    for _ in rollbacks if schedule_of(model.optimizer) is not None else ():
        halve(model)
    return list(rollbacks)


def settle(model, task: str) -> None:
    """After `fit`: a `Scaled` schedule (rollbacks under a schedule not of Keras's) is taken
    off the optimizer again, which holds the user's own schedule as they made it (a plain
    Keras load of their `model.save` needs nothing of distrib_tf); said in one line."""
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    scaled = getattr(inner, "_learning_rate", None)  # Read only (a user's schedule need not deserialize).
    if not isinstance(scaled, Scaled):
        return
    inner.learning_rate = scaled.schedule
    model.train_function = model.test_function = None
    print(f"{task}: the rollbacks trained on {scaled.factor:g} of the learning rate of "
          f"{type(scaled.schedule).__name__}, not one of Keras's schedules (whose rates distrib_tf halves): after fit "
          "the optimizer holds it as made, not scaled, and a later fit trains on that", flush=True)
