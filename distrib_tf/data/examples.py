"""Any user's data, read by example id: what the run API trains on, in the exact order.

An `Examples` is a split that can be read by id: `read(ids) -> (x, y)` gives the batch of
those examples, inside the `tf.data` graph. The order (`distrib_tf.data.order`) picks the
ids of every global step from `(seed, epoch, position)`, so a run resumed at any step reads
from that step on and nothing before it (O(1)), and one process or any number of workers
train on the same global batches.

- `from_arrays(x, y)`: arrays in memory; `x` one array or a dict of them (several inputs),
  `y` one array, a dict, or `None`; any dtype (float targets stay float);
- `from_source(source)`: anything with `__len__` and `__getitem__(i)` (the shape of
  `tfds.data_source`, Grain's `RandomAccessDataSource`, a list), an element being a
  `(x, y)` tuple or a dict whose `label` key is the target;
- `from_images(directory)`: an image folder (one subfolder per class), read by id;
- `load(name, split)`: a registered dataset, `array_record:DIR` or `images:DIR`.

The escape hatch: `from_dataset_fn(fn, steps_per_epoch=N)` takes a plain `tf.data`
function. Its order is the function's own, so its resume is not exact by construction: a
run resumed at step `s` skips `s` batches of the function's dataset (reading them, O(s)),
which gives the same batches only if the function is deterministic.

Example:

    >>> train = from_arrays({"image": x, "meta": m}, y)
    >>> train.num_examples
    1024
"""

import dataclasses
import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from distrib_tf.data import readers
from distrib_tf.data import registry


@dataclasses.dataclass(frozen=True)
class Examples:
    """A split read by example id.

    Attributes:
        name: what the examples are, for messages and for the run's identity.
        num_examples: examples in the split; ids are `0 … num_examples - 1`.
        make_reader: returns `read(ids) -> (x, y)` for a `[n]` int64 vector of ids; called
            once per input pipeline, inside it.
        fingerprint: what must match for a backup of a run on these examples to resume.
        info: the dataset's description, where it has one (for a model builder).
        full_batches: an epoch is its full global batches only (the main job's); else every
            example, the last batch holding the rest, as Keras's `fit` trains arrays.
    """

    name: str
    num_examples: int
    make_reader: Callable
    fingerprint: str = ""
    info: registry.DatasetInfo | None = None
    full_batches: bool = False

    def steps_per_epoch(self, global_batch_size: int) -> int:
        """Global batches in one pass (`⌈N / B⌉`, or `⌊N / B⌋` with `full_batches`)."""
        if not self.full_batches:
            return -(-self.num_examples // global_batch_size)
        steps = self.num_examples // global_batch_size
        if steps < 1:
            raise ValueError(f"Invalid value for argument `global_batch_size`. Received: {global_batch_size}. "
                             f"Expected at most the {self.num_examples} examples of {self.name}.")
        return steps


@dataclasses.dataclass(frozen=True)
class DatasetFn:
    """A plain `tf.data` function: `fn(input_context)` gives this pipeline's per-replica batches,
    endless (`repeat()`). Its resume skips batches: exact only for a deterministic function."""

    fn: Callable
    steps_per_epoch_: int
    name: str = "a tf.data function"

    def steps_per_epoch(self, global_batch_size: int) -> int:  # pylint: disable=unused-argument
        return self.steps_per_epoch_


@dataclasses.dataclass(frozen=True)
class Batches:
    """Global batches as Keras's `fit` takes them (a batched `tf.data.Dataset`, a
    `keras.utils.PyDataset`), an epoch one pass over them.

    Attributes:
        batches: `batches(start_step, endless, seed=None)`: the batches from global step
            `start_step` on, to the end of its epoch or without end; in an order keyed by
            `seed` and the epoch where it reorders batches (`shuffle`), else `seed` unused.
        steps_per_epoch_: batches an epoch; `None` for data read as it is, to its end
            each time (a validation set of unknown length, as Keras reads it).
        name: for messages.
        skips: its resume reads and drops the batches before `start_step` (exact only when
            they come again alike); else it reads batch `i` by index.
        batch_size_: the global batch, where known without reading a batch.
        unreplayable: its draws that follow threads' order (`replay.unreplayable`).
        note: one line for the user, said once where the run starts to train on it (what
            reading it costs, or a guarantee it cannot have).
    """

    batches: Callable
    steps_per_epoch_: int | None
    name: str
    skips: bool
    batch_size_: int | None = None
    unreplayable: tuple = ()
    note: str = ""

    def steps_per_epoch(self, global_batch_size: int) -> int | None:  # pylint: disable=unused-argument
        return self.steps_per_epoch_

    def batch_size(self) -> int:
        """The global batch: the dataset's own (read from its `batch` op where the shape does not
        say), else the first batch's rows (reading it from an iterator of its own)."""
        if self.batch_size_ is not None:
            return self.batch_size_
        return int(tf.nest.flatten(next(iter(self.batches(0, False))))[0].shape[0])


def from_dataset_fn(fn: Callable, *, steps_per_epoch: int) -> DatasetFn:
    """The escape hatch: a `tf.data` function of the user's, with an inexact resume.

    Args:
        fn: `fn(input_context) -> tf.data.Dataset` of this input pipeline's per-replica
            batches (`input_context.get_per_replica_batch_size(global_batch_size)`),
            repeated without end.
        steps_per_epoch: global steps an epoch.
    """
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(f"Invalid value for argument `steps_per_epoch`. Received: {steps_per_epoch!r}. "
                         "Expected a positive integer.")
    return DatasetFn(fn, steps_per_epoch)


def _digest(arrays) -> str:
    """Shapes, dtypes and the first MiB of every array: cheap, and changes with the data."""
    digest = hashlib.sha256()
    for array in arrays:
        if isinstance(array, tf.RaggedTensor):  # Its rows' lengths, then its values.
            digest.update(array.row_splits.numpy().tobytes())
            array = array.flat_values.numpy()
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(np.ascontiguousarray(array.reshape(-1)[: (1 << 20) // max(array.itemsize, 1)]).tobytes())
    return digest.hexdigest()[:16]


def as_array(leaf):
    """An array of rows as a run reads it: a `tf.RaggedTensor` stays one (rows of any
    length), `None` stays `None` (a model's optional input, as Keras passes it), anything
    else becomes a NumPy array."""
    if leaf is None or isinstance(leaf, tf.RaggedTensor):
        return leaf
    return np.asarray(leaf)


def num_rows(array) -> int | None:
    """Rows of an `as_array` leaf; `None` for `None` or a scalar."""
    if array is None:
        return None
    if isinstance(array, tf.RaggedTensor):
        return int(array.nrows())
    return array.shape[0] if array.ndim else None


def _as_arrays(structure, what: str):
    try:
        return tf.nest.map_structure(as_array, structure)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Invalid value for argument `{what}`. Received: {type(structure).__name__}. "
                        "Expected an array, or a dict of arrays with one row per example.") from e


def from_arrays(x: Any, y: Any = None, *, sample_weight: Any = None, name: str = "arrays") -> Examples:
    """Examples held in memory: row `i` of every array is example `i`.

    Args:
        x: an array, or a dict (or tuple) of arrays: a model with several inputs (a
            `tf.RaggedTensor` of rows of any length, `None` for an optional one).
        y: the targets: an array of any dtype, a dict of arrays (several outputs), or `None`.
        sample_weight: one weight per example (Keras's `sample_weight`), or `None`.
        name: for messages.

    Raises:
        ValueError: the arrays do not all have the same number of rows, or none.
    """
    x = _as_arrays(x, "x")
    y = None if y is None else _as_arrays(y, "y")
    weights = None if sample_weight is None else _as_arrays(sample_weight, "sample_weight")
    if weights is not None and y is None:
        raise ValueError("Invalid value for argument `sample_weight` of from_arrays. Received: weights without "
                         "targets (y=None). Expected targets `y` beside them.")
    flat = [a for part in (x, y, weights) if part is not None for a in tf.nest.flatten(part) if a is not None]
    rows = {num_rows(a) for a in flat}
    if len(rows) != 1 or None in rows or 0 in rows:
        raise ValueError(f"Invalid value for argument `x`/`y` of from_arrays. Received: arrays of "
                         f"{sorted(num_rows(a) or 0 for a in flat)} rows. Expected the same "
                         "number of rows (examples), at least one, in every array.")

    def make_reader():
        parts = x if y is None else (x, y) if weights is None else (x, y, weights)
        tensors = tf.nest.map_structure(lambda a: a if a is None or isinstance(a, tf.RaggedTensor)
                                        else tf.constant(a), parts)

        def read(ids):
            return tf.nest.map_structure(lambda t: None if t is None else tf.gather(t, ids), tensors)

        return read

    return Examples(name, rows.pop(), make_reader, fingerprint=_digest(flat))


def from_source(source: Any, *, label: str = "label", name: str | None = None) -> Examples:
    """Examples of a random-access source: `len(source)` of them, `source[i]` the `i`th.

    An element is a `(x, y)` tuple, or a dict: its `label` key is the target and the other
    keys are the features (one feature: `x` is that array; several: `x` is their dict). Each
    batch is read in the input pipeline's threads (`source.__getitems__(ids)` where the
    source has it, as `tfds.data_source` does), outside TensorFlow's graph.

    Raises:
        TypeError: `source` has no `__len__` or `__getitem__`, or its elements are not
            tuples or dicts of arrays.
    """
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(f"Invalid value for argument `source`. Received: {type(source).__name__}. Expected a "
                        "random-access source with `__len__` and `__getitem__` (such as tfds.data_source).")
    size = len(source)
    if size < 1:
        raise ValueError(f"Invalid value for argument `source`. Received: {size} examples. Expected at least one.")
    first = _split_element(source[0], label)
    flat = [np.asarray(a) for a in tf.nest.flatten(first)]
    dtypes = [tf.as_dtype(a.dtype) if a.dtype.kind not in "US" else tf.string for a in flat]

    def fetch(ids):
        ids = [int(i) for i in ids]
        items = source.__getitems__(ids) if hasattr(source, "__getitems__") else [source[i] for i in ids]
        elements = [tf.nest.flatten(_split_element(item, label)) for item in items]
        return [np.stack([e[k] for e in elements]).astype(a.dtype if a.dtype.kind not in "US" else object)
                for k, a in enumerate(flat)]

    def make_reader():
        def read(ids):
            found = tf.numpy_function(fetch, [ids], dtypes, stateful=False)
            for tensor, array in zip(found, flat):
                tensor.set_shape([None, *array.shape])
            return tf.nest.pack_sequence_as(first, found)

        return read

    return Examples(name or type(source).__name__, size, make_reader,
                    fingerprint=f"{size}-{_digest(flat)}")


def _split_element(element, label):
    if isinstance(element, tuple) and len(element) == 2:
        return element
    if isinstance(element, dict) and label in element:
        features = {k: v for k, v in element.items() if k != label}
        return (next(iter(features.values())) if len(features) == 1 else features), element[label]
    raise TypeError(f"Invalid value for an element of the source. Received: {type(element).__name__}"
                    f"{' with keys ' + str(sorted(element)) if isinstance(element, dict) else ''}. Expected an "
                    f"(x, y) tuple, or a dict with a {label!r} key (pass `label=` to name another).")


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def from_images(directory: str, *, image_size: tuple[int, int] = (28, 28), channels: int = 3) -> Examples:
    """An image folder: `directory/<class>/<image>`, classes in sorted order as labels 0, 1, ….

    Images are read by id and decoded in the graph (JPEG, PNG, GIF, BMP), as float32 in
    [0, 1] resized to `image_size`; the label is an int64.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Invalid value for argument `directory`. Received: {directory!r}. Expected a "
                                "folder of class folders of images.")
    classes = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    paths, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted(os.listdir(os.path.join(directory, name))):
            if file.lower().endswith(IMAGE_SUFFIXES):
                paths.append(os.path.join(directory, name, file))
                labels.append(label)
    if not paths:
        raise ValueError(f"Invalid value for argument `directory`. Received: {directory!r}, which holds no "
                         f"images. Expected class folders of {', '.join(IMAGE_SUFFIXES)} files.")
    shape = [*image_size, channels]
    info = registry.DatasetInfo(f"images:{directory}", "image", len(classes), tuple(shape),
                                num_examples={"train": len(paths)}, data_dir=os.path.abspath(directory))

    def make_reader():
        files, targets = tf.constant(paths), tf.constant(labels, tf.int64)

        def read(ids):
            images = tf.map_fn(lambda path: readers.decode_image(tf.io.read_file(path), shape),
                               tf.gather(files, ids), fn_output_signature=tf.TensorSpec(shape, tf.float32))
            return images, tf.gather(targets, ids)

        return read

    digest = hashlib.sha256("\n".join(paths).encode()).hexdigest()[:16]
    return Examples(info.name, len(paths), make_reader, fingerprint=digest, info=info)


def load(name: str, split: str = "train", *, data_dir: str | None = None) -> Examples:
    """A split of a registered dataset, of `array_record:DIR` or of `images:DIR`.

    Raises:
        ValueError: an unknown name or split.
        FileNotFoundError: a dataset that is not prepared.
    """
    if name.startswith("images:"):
        return from_images(name[len("images:"):])
    info = readers.load_info(name, data_dir=data_dir)
    readers.check_random_access(info)
    if split not in info.num_examples:
        raise ValueError(f"Invalid value for argument `split`. Received: {split!r}. Expected one of the splits "
                         f"of {name}: {', '.join(info.num_examples)}.")
    return Examples(f"{name} {split}", info.num_examples[split], lambda: readers.make_reader(info, split),
                    fingerprint=f"{name}:{split}:{info.num_examples[split]}", info=info)
