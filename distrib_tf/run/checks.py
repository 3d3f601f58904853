"""`Run.fit`'s arguments, checked before anything runs: one `InvalidRun` line each."""

import keras

from distrib_tf.data import examples as examples_lib
from distrib_tf.data import registry
from distrib_tf.run.ending import InvalidRun
from distrib_tf.run.options import check_positive
from distrib_tf.run.options import invalid


def _check_model(model, strategy) -> None:
    """A compiled `keras.Model` built under `strategy.scope()`."""
    if not isinstance(model, keras.Model):
        invalid("model", type(model).__name__, "a keras.Model")
    if not model.compiled:
        raise InvalidRun("Invalid value for argument `model`: it is not compiled. Expected "
                         "`model.compile(optimizer=..., loss=...)` under `run.strategy.scope()` first.")
    # A model built before the run reads the run's strategy as its own (Keras asks for the default
    # one when it has none) but its variables are not the strategy's: every worker would train alone.
    if model.distribute_strategy is not strategy or not all(
            strategy.extended.variable_created_in_scope(v.value) for v in model.variables[:1]):
        raise InvalidRun(f"Invalid value for argument `model`: {model.name!r} was built under another strategy "
                         "(before `distrib_tf.Run(...)`, or under another Run). Expected it built after "
                         "`distrib_tf.Run(...)`, whose strategy is then the default, or under "
                         "`with run.strategy.scope():`.")


def check_fit(model, strategy, train, *, epochs, global_batch_size, steps_per_epoch, validation_data,
              validation_steps, validation_batch_size=None) -> tuple[int, int | None]:
    """`Run.fit`'s arguments; returns the steps of an epoch and of a validation."""
    _check_model(model, strategy)
    check_positive("epochs", epochs, optional=False)
    check_positive("steps_per_epoch", steps_per_epoch)
    check_positive("validation_steps", validation_steps)
    for name, value in (("train", train), ("validation_data", validation_data)):
        if value is not None and not isinstance(value, (examples_lib.Examples, examples_lib.DatasetFn,
                                                        examples_lib.Batches)):
            invalid(name, type(value).__name__, "arrays, a tf.data.Dataset or distrib_tf.data examples "
                     "(from_arrays, from_source, from_images, load, from_dataset_fn)")
    try:
        for name, batch in (("batch_size", global_batch_size), ("validation_batch_size", validation_batch_size)):
            check_positive(name, batch, optional=name != "batch_size")
            if isinstance(train, examples_lib.Examples) and train.full_batches:
                registry.check_global_batch_size(batch or global_batch_size, strategy.num_replicas_in_sync)
        steps = steps_per_epoch or train.steps_per_epoch(global_batch_size)
        if isinstance(train, examples_lib.Examples) and steps > train.steps_per_epoch(global_batch_size):
            invalid("steps_per_epoch", steps, f"at most {train.steps_per_epoch(global_batch_size)} steps "
                     f"of {global_batch_size} in the {train.num_examples} examples of {train.name}")
        val_steps = None
        if validation_data is not None:
            val_steps = validation_steps or validation_data.steps_per_epoch(validation_batch_size or global_batch_size)
    except InvalidRun:
        raise
    except ValueError as e:
        raise InvalidRun(str(e)) from e
    return steps, val_steps


def check_initial_epoch(initial_epoch, epochs: int) -> None:
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
        invalid("initial_epoch", initial_epoch, f"an integer from 0 to epochs - 1 ({epochs - 1})")
