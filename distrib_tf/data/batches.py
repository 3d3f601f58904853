"""Keras's batched inputs as `Batches`: a `tf.data.Dataset`, a `keras.utils.PyDataset`, a generator.

Each keeps the meaning Keras's `fit` gives it (`keras/src/trainers/data_adapters/`), with
Keras's own helpers where they serve (`class_weight`, a generator's first batches):

- `from_dataset`: a batched `tf.data.Dataset`, replayed to a step (`distrib_tf.data.replay`);
  one of unknown length (a TFRecord file, a `filter`, `from_generator`) is read once to count
  its batches, which Keras learns by reading its first epoch to the end;
- `from_py_dataset`: batch `i` read by index, the order of an epoch's batches reshuffled
  by `(seed, epoch)` where `fit(shuffle=True)` asks (as Keras reshuffles it each epoch);
- `from_generator`: a Python generator, read on through one iterator, as Keras reads it.

Example:

    >>> batches = from_dataset(tf.data.TFRecordDataset(files).map(parse).batch(32))
    >>> batches.steps_per_epoch_  # Counted: one pass over the files.
    40
"""

from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.trainers.data_adapters import generator_data_adapter
from keras.src.trainers.data_adapters import tf_dataset_adapter

from distrib_tf.data import order
from distrib_tf.data import replay
from distrib_tf.data.examples import Batches


def count_batches(dataset: tf.data.Dataset) -> int:
    """The batches of one pass over `dataset`, read to its end (a reshuffling `shuffle` in it
    draws its seeds once more, in every process alike)."""
    return int(dataset.reduce(np.int64(0), lambda count, *_: count + 1))


def from_dataset(dataset: tf.data.Dataset, *, steps_per_epoch: int | None = None,
                 class_weight: dict | None = None) -> Batches:
    """A batched `tf.data.Dataset`, as Keras's `fit(dataset)` takes it. Its resume replays
    `dataset.repeat()` from its start in a fresh process, dropping the batches before
    `start_step`: exact when every iterator a run makes of it comes in the same order
    (`distrib_tf.data.replay`) and its randomness is seeded.

    Args:
        dataset: batched, as `fit` takes it.
        steps_per_epoch: batches an epoch; by default its length, counted by one pass where
            its cardinality is unknown.
        class_weight: Keras's: each example weighs its class's weight (Keras's own map).

    Raises:
        ValueError: it is infinite and `steps_per_epoch` is not given, or it is empty.
    """
    if class_weight is not None:
        dataset = tf_dataset_adapter.TFDatasetAdapter(dataset, class_weight=class_weight).get_tf_dataset()
    note = ""
    if steps_per_epoch is None:
        cardinality = int(dataset.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError("Invalid value for argument `x`. Received: a tf.data.Dataset of infinite length. "
                             "Expected `steps_per_epoch` with it (or a dataset of known length).")
        if cardinality == tf.data.UNKNOWN_CARDINALITY:
            cardinality = count_batches(dataset)
            note = (f"a tf.data.Dataset of unknown length: read once to count its {cardinality} batches an "
                    "epoch (Keras learns it in the first epoch); steps_per_epoch skips this pass")
        if cardinality < 1:
            raise ValueError("Invalid value for argument `x`. Received: a tf.data.Dataset of 0 batches. "
                             "Expected at least one.")
        steps_per_epoch = cardinality

    def batches(start_step: int, endless: bool, seed=None) -> tf.data.Dataset:  # pylint: disable=unused-argument
        if endless:
            return dataset.repeat().skip(start_step)
        return dataset.repeat().skip(start_step).take(steps_per_epoch - start_step % steps_per_epoch)  # Epoch's rest.

    return Batches(batches, steps_per_epoch, "a tf.data.Dataset", skips=True, batch_size_=replay.batch_size(dataset),
                   unreplayable=tuple(replay.unreplayable(dataset)), note=note)


def as_it_is(data) -> Batches:
    """A `tf.data.Dataset` or a Python generator read as it is, each time to its end (or to
    Keras's `validation_steps`, read on from epoch to epoch): a validation set of unknown
    length, as Keras's `fit` reads one (a generator through Keras's own adapter).

    Raises:
        ValueError: a generator that yields no batch, or not tuples (Keras's checks).
    """
    name = "a tf.data.Dataset"
    if not isinstance(data, tf.data.Dataset):
        data, name = generator_data_adapter.GeneratorDataAdapter(data).get_tf_dataset(), "a Python generator"
    return Batches(lambda start_step, endless, seed=None: data, None, name, skips=True,
                   batch_size_=replay.batch_size(data))


def from_generator(generator, *, steps_per_epoch: int | None) -> Batches:
    """A Python generator of batches, as Keras's `fit` reads one (its `GeneratorDataAdapter`):
    one iterator, `steps_per_epoch` batches an epoch, read on from epoch to epoch. It cannot
    be read twice: a resume reads a new generator's batches up to its step (the same batches
    only if it yields them again alike), and a rollback cannot go back in it.

    Raises:
        ValueError: it yields no batch, or not tuples; `steps_per_epoch` is not given
            (counting its batches would consume them).
    """
    if steps_per_epoch is None:
        raise ValueError("Invalid value for argument `steps_per_epoch`. Received: None with a Python generator, "
                         "whose batches cannot be counted without consuming them. Expected the batches an epoch "
                         "(or tf.data.Dataset.from_generator of a function that makes the generator anew).")
    first, restored = generator_data_adapter.peek_and_restore(generator)
    adapter = generator_data_adapter.GeneratorDataAdapter(restored())  # Keras's checks of its batches.
    dataset = adapter.get_tf_dataset()
    rows = tf.nest.flatten(first[0])[0]

    def batches(start_step: int, endless: bool, seed=None) -> tf.data.Dataset:  # pylint: disable=unused-argument
        return dataset.skip(start_step) if endless else dataset.skip(start_step).take(
            steps_per_epoch - start_step % steps_per_epoch)

    return Batches(batches, steps_per_epoch, "a Python generator", skips=True, batch_size_=int(np.shape(rows)[0]),
                   note="a Python generator cannot be read twice: a resume reads a new one's batches up to its step "
                        "(the same batches only if it yields them alike) and a rollback cannot go back in it")


def _standardized(batch, class_weight):
    """A PyDataset's batch as Keras's adapter takes it: a tuple (an array `(x,)`), with the
    weights of `class_weight` (Keras's own function) beside `(x, y)`."""
    if isinstance(batch, dict):
        return batch
    batch = (batch,) if isinstance(batch, np.ndarray) else tuple(batch) if isinstance(batch, list) else batch
    if class_weight is not None and isinstance(batch, tuple) and len(batch) == 2:
        batch = (*batch, data_adapter_utils.class_weight_to_sample_weights(np.asarray(batch[1]), class_weight))
    return batch


def from_py_dataset(py_dataset: Any, *, class_weight: dict | None = None) -> Batches:
    """A `keras.utils.PyDataset` (anything with `__len__` and `__getitem__(i)` giving batch
    `i` as `x`, `(x, y)` or `(x, y, sample_weight)`), read by index: a resume at step `s`
    reads epoch `e = s div len`'s batch `s mod len` after calling `on_epoch_end()` once per
    epoch before it, as Keras calls it after every epoch. Shuffled (`batches(..., seed=)`),
    epoch `e`'s batches come in an order keyed by `(seed, e)` (`distrib_tf.data.order`), as
    Keras's `fit(shuffle=True)` reorders them each epoch. Exact when `on_epoch_end` is
    deterministic (a shuffle seeded by the epoch is). Batches are read one at a time.

    Raises:
        ValueError: it has no batch, or batches with weights beside `class_weight`.
    """
    size = len(py_dataset)
    if size < 1:
        raise ValueError(f"Invalid value for argument `x`. Received: a {type(py_dataset).__name__} of {size} "
                         "batches. Expected at least one.")
    first = _standardized(py_dataset[0], None)
    if class_weight is not None and not (isinstance(first, tuple) and len(first) == 2):
        raise ValueError(f"Invalid value for argument `class_weight`. Received: {class_weight!r} with batches "
                         f"of {type(py_dataset).__name__} that are not (x, y). Expected None beside their own "
                         "weights (as Keras's fit)")
    first = _standardized(first, class_weight)
    flat = [np.asarray(a) for a in tf.nest.flatten(first)]
    dtypes = [tf.as_dtype(a.dtype) for a in flat]
    epochs_ended = [0]  # The on_epoch_end() calls so far (Keras's, as fit would have made them).

    def fetch(epoch, index):
        while epochs_ended[0] < int(epoch):
            if hasattr(py_dataset, "on_epoch_end"):
                py_dataset.on_epoch_end()
            epochs_ended[0] += 1
        batch = _standardized(py_dataset[int(index)], class_weight)
        return [np.asarray(a, dtype=f.dtype) for a, f in zip(tf.nest.flatten(batch), flat)]

    def read(step, seed):
        epoch, index = step // size, step % size
        if seed is not None:
            index = order.example_ids(index[None], epoch, num_examples=size, seed=seed, shuffle=True)[0]
        found = tf.numpy_function(fetch, [epoch, index], dtypes, stateful=True)
        for tensor, array in zip(found, flat):
            tensor.set_shape([None, *array.shape[1:]])
        return tf.nest.pack_sequence_as(first, found)

    def batches(start_step: int, endless: bool, seed=None) -> tf.data.Dataset:
        stop = tf.int64.max if endless else (start_step // size + 1) * size
        return tf.data.Dataset.range(start_step, stop).map(lambda step: read(step, seed)).prefetch(2)

    return Batches(batches, size, type(py_dataset).__name__, skips=False, batch_size_=len(flat[0]))
