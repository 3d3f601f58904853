"""Keras `fit`'s data arguments, with Keras's meanings, as what a run trains on.

- arrays (`x`, `y`, `sample_weight`; one array, a dict or a tuple of them): read by id in
  the run's order (`distrib_tf.data.from_arrays`), so a resume is exact; `validation_split`
  holds out the last fraction of the rows before any shuffling, as Keras does; `class_weight`
  becomes one weight per training example by Keras's own function (the validation rows
  stay unweighted, as in Keras);
- a `tf.data.Dataset` (batched, as `fit` takes one): its own order, resumed by replaying it
  (`distrib_tf.data.from_dataset`), through one iterator a stage (`OneIterator`); one of
  unknown length counted by one pass; `class_weight` by Keras's own map;
- a `keras.utils.PyDataset`: batch `i` read by index, so resumed at its step without
  reading the batches before it, reshuffled each epoch by `(seed, epoch)` with `shuffle`
  (`distrib_tf.data.from_py_dataset`); `class_weight` by Keras's own function;
- a Python generator, with `steps_per_epoch`: read on, as Keras reads it; it cannot be
  replayed, which `Run.fit` says in one line (`distrib_tf.data.batches.from_generator`);
- a `batch_size` beside any of them is ignored, as Keras ignores it;
- distrib_tf's own sources (`from_arrays`, `from_source`, `from_images`, `load`,
  `from_dataset_fn`) as they are.

`validation_data` takes the same forms: a tuple (or list) `(x, y)` or `(x, y, sample_weight)`,
a dataset, a PyDataset, a generator, or a source; a dataset of unknown length and a
generator are read as they are, as Keras reads them (to their end, or `validation_steps`).
"""

import inspect
import math

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils
from tensorflow.python.distribute import input_lib

from distrib_tf.data import batches as batches_lib
from distrib_tf.data import examples as examples_lib
from distrib_tf.run.ending import InvalidRun
from distrib_tf.run.options import invalid

SOURCES = (examples_lib.Examples, examples_lib.DatasetFn, examples_lib.Batches)


def training_data(x, y, *, sample_weight, class_weight, validation_split: float, validation_data,
                  steps_per_epoch: int | None):
    """`fit`'s data arguments as `(train, validation)`: sources of `distrib_tf.data`."""
    if isinstance(validation_split, bool) or not 0.0 <= validation_split < 1.0:
        invalid("validation_split", validation_split, "a fraction in [0, 1)")
    if x is None:
        invalid("x", None, "arrays, a tf.data.Dataset or a distrib_tf.data source")
    if _is_batched(x):
        _check_batched(x, y=y, sample_weight=sample_weight, class_weight=class_weight,
                       validation_split=validation_split)
        return (_source(x, "x", steps_per_epoch, class_weight=class_weight),
                validation_of(validation_data))
    x, y = _arrays(x, "x"), (None if y is None else _arrays(y, "y"))
    weights = None if sample_weight is None else np.asarray(sample_weight)
    if class_weight is not None and weights is not None:
        invalid("class_weight", class_weight, "None beside sample_weight (Keras takes one or the other)")
    validation = validation_of(validation_data)
    if validation_split:
        if validation_data is not None:
            invalid("validation_split", validation_split, "0 beside validation_data (Keras takes one or the other)")
        rows = next(n for n in map(examples_lib.num_rows, tf.nest.flatten(x)) if n is not None)
        split_at = int(math.floor(rows * (1.0 - validation_split)))
        held_out = [_rows(part, slice(split_at, None)) for part in (x, y, weights)]
        validation = examples_lib.from_arrays(*held_out[:2], sample_weight=held_out[2], name="validation_split")
        x, y, weights = (_rows(part, slice(None, split_at)) for part in (x, y, weights))
    if class_weight is not None:  # The training rows only, as Keras weighs them.
        weights = _class_weights(y, class_weight)
    return examples_lib.from_arrays(x, y, sample_weight=weights), validation


def _is_batched(x) -> bool:
    """Data that holds its own batches, targets and weights (Keras's datasets and generators, our sources)."""
    return (isinstance(x, (*SOURCES, tf.data.Dataset)) or inspect.isgenerator(x)  # pylint: disable=isinstance-second-argument-not-valid-type
            or _is_py_dataset(x))


def _check_batched(x, *, y, sample_weight, class_weight, validation_split) -> None:
    """Keras's refusals beside batched data: `y` and `sample_weight` are in its batches;
    `class_weight` only with a dataset or a PyDataset; no `validation_split`."""
    kind = type(x).__name__
    weighs = isinstance(x, tf.data.Dataset) or _is_py_dataset(x)  # Keras weighs their batches' (x, y).
    for name, value in (("y", y), ("sample_weight", sample_weight), ("class_weight", class_weight)):
        if value is not None and not (name == "class_weight" and weighs):
            invalid(name, type(value).__name__, f"None with x a {kind}, which holds its own targets and weights "
                     "(as Keras's fit)")
    if class_weight is not None and not isinstance(class_weight, dict):
        invalid("class_weight", type(class_weight).__name__, "a dict of class index to weight")
    if validation_split:
        invalid("validation_split", validation_split, f"0 with x a {kind}: Keras splits arrays only. "
                 "Pass validation_data instead")


def validation_of(data):
    """`validation_data` as a source, or `None`."""
    if data is None:
        return None
    if isinstance(data, list):  # Keras takes a list as the tuple.
        data = tuple(data)
    if isinstance(data, tuple) and len(data) in (2, 3) and not isinstance(data[0], SOURCES):
        x, y, *weights = data
        return examples_lib.from_arrays(_arrays(x, "validation_data"), _arrays(y, "validation_data"),
                                        sample_weight=weights[0] if weights else None, name="validation_data")
    if inspect.isgenerator(data) or (isinstance(data, tf.data.Dataset)
                                     and int(data.cardinality()) == tf.data.UNKNOWN_CARDINALITY):
        return _source(data, "validation_data", None, as_it_is=True)  # To its end, or `validation_steps` read on.
    return _source(data, "validation_data", None)


def _is_py_dataset(data) -> bool:
    return isinstance(data, keras.utils.PyDataset) or (
        hasattr(data, "__getitem__") and hasattr(data, "__len__") and hasattr(data, "on_epoch_end"))


def _source(data, argument: str, steps_per_epoch: int | None, *, class_weight=None, as_it_is=False):
    if isinstance(data, SOURCES):
        return data
    try:
        if as_it_is:  # Keras reads it as it is: each validation to its end, or `validation_steps` read on.
            return batches_lib.as_it_is(data)
        if inspect.isgenerator(data):
            return batches_lib.from_generator(data, steps_per_epoch=steps_per_epoch)
        if _is_py_dataset(data):
            return batches_lib.from_py_dataset(data, class_weight=class_weight)
        if isinstance(data, tf.data.Dataset):
            return batches_lib.from_dataset(data, steps_per_epoch=steps_per_epoch, class_weight=class_weight)
    except InvalidRun:
        raise
    except ValueError as e:  # Keras's own checks (a generator's batches, class_weight) word theirs.
        message = str(e) if str(e).startswith("Invalid value") else f"Invalid value for argument `{argument}`: {e}"
        raise InvalidRun(message) from e
    invalid(argument, type(data).__name__, "arrays, a tuple (x, y), a tf.data.Dataset, a keras.utils.PyDataset, "
             "a generator or a distrib_tf.data source")


def _arrays(structure, argument: str):
    """The arrays of `structure`, its lists as tuples (as Keras's array adapter takes them: a
    list of outputs' targets stays a structure, never one stacked array)."""
    try:
        return tf.nest.map_structure(examples_lib.as_array, keras.tree.lists_to_tuples(structure))
    except (TypeError, ValueError):
        invalid(argument, type(structure).__name__, "an array, or a dict or tuple of arrays")


def _rows(structure, rows: slice):
    return None if structure is None else tf.nest.map_structure(lambda a: None if a is None else a[rows], structure)


def _class_weights(y, class_weight: dict) -> np.ndarray:
    """Keras's own: each example weighs its class's weight, 1.0 for a class the dict does not
    name (`y` class ids, rounded, or one-hot rows)."""
    if y is None or len(tf.nest.flatten(y)) != 1:
        invalid("class_weight", class_weight, "None with several outputs or no targets (as Keras's fit)")
    if not isinstance(class_weight, dict):
        invalid("class_weight", type(class_weight).__name__, "a dict of class index to weight")
    return data_adapter_utils.class_weight_to_sample_weights(tf.nest.flatten(y)[0], class_weight)


def batch_size_of(train, batch_size: int | None) -> int:
    """The global batch: `batch_size` (Keras's default 32 for arrays), or batched data's own
    (a `batch_size` beside it is ignored, as Keras's `fit` ignores it: `Run.fit` says so)."""
    if not isinstance(train, examples_lib.Batches):
        return 32 if batch_size is None else batch_size
    return train.batch_size()


def say(train, batch_size: int | None, *, task: str) -> None:
    """One line each: what batched data costs or cannot guarantee (`Batches.note`), and a
    `batch_size` beside it, ignored as Keras's `fit` ignores it."""
    if not isinstance(train, examples_lib.Batches):
        return
    if train.note:
        print(f"{task}: {train.note}", flush=True)
    if batch_size is not None:
        print(f"{task}: batch_size={batch_size} ignored: x, {train.name}, is batched already (as Keras's fit "
              "ignores it)", flush=True)


class OneIterator(input_lib.DistributedDataset):  # pylint: disable=abstract-method
    """A distributed dataset whose every `iter()` is one and the same iterator: every `fit`
    call of a stage (a resumed partial epoch, then the rest) reads on where the last one
    stopped, as the uninterrupted run's single `fit` did. A second iterator of a user's
    dataset would draw the next reshuffle seeds and read its `cache()` anew
    (`distrib_tf.data.replay`)."""

    def __init__(self, distributed):  # pylint: disable=super-init-not-called  (a view of `distributed`)
        self._distributed, self._iterator = distributed, None

    def __iter__(self):
        if self._iterator is None:
            self._iterator = iter(self._distributed)
        return self._iterator

    @property
    def element_spec(self):
        return self._distributed.element_spec

    @property
    def cardinality(self):
        return self._distributed.cardinality

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_distributed", "_iterator"):
            raise AttributeError(name)
        return getattr(self._distributed, name)
