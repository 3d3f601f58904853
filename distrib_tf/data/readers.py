"""Readers: any dataset's description, and the examples of a batch of ids, decoded in the graph.

`load_info(name)` describes a dataset (checking prepared shards before anything trains).

`make_reader(info, split)` returns `read(ids) -> (x, y)`, a function for `tf.data` that
takes a vector of example ids (`distrib_tf.data.order`) and returns that batch:

- offline datasets: gathered from the arrays in memory (they are small);
- `array_record:DIR`: the records fetched by index from the ArrayRecord shards (a batch
  at a time, several batches at once in the input pipeline's threads,
  `records.RecordReader`), then decoded in the graph on the worker that trains on them
  and for its own examples only: raw tensors come as one uint8 array of rows, sliced and
  bitcast (no string per record); images by `tf.io.decode_image`, resized;
- TFDS datasets: through `tfds.data_source` (`distrib_tf.data.tfds_source`).

A pipeline reads only the ids it is given, so a worker reads its own share of a split.
"""

import numpy as np
import tensorflow as tf

from distrib_tf.data import records
from distrib_tf.data import registry
from distrib_tf.data import tfds_source


def load_info(name: str, *, data_dir: str | None = None) -> registry.DatasetInfo:
    """Describes a dataset without reading its examples; checks prepared shards.

    For TFDS datasets this starts TensorFlow's runtime: call `make_strategy()` first.

    Raises:
        ValueError: an unknown name, or shards that disagree with their `dataset.json`
            (`records.DataError`).
        FileNotFoundError: a TFDS dataset that is not prepared in `data_dir`.
    """
    registry.check_dataset_name(name)
    if name in registry.OFFLINE:
        return registry.OFFLINE[name][1]
    if name.startswith(registry.PREPARED):
        return registry.prepared_info(name[len(registry.PREPARED):])
    return tfds_source.load_info(name, data_dir)


def check_random_access(info: registry.DatasetInfo) -> None:
    """Raises `ValueError` unless the examples of `info` can be read by index (before training)."""
    if info.name not in registry.OFFLINE and not info.name.startswith(registry.PREPARED):
        tfds_source.data_source(info, "train")


def make_reader(info: registry.DatasetInfo, split: str):
    """`read(ids) -> (x, y)`: the examples with those ids (an int64 vector)."""
    if info.name in registry.OFFLINE:
        x, y = registry.OFFLINE[info.name][0](split)
        x, y = tf.constant(x), tf.constant(y)
        return lambda ids: (tf.gather(x, ids), tf.gather(y, ids))
    if info.name.startswith(registry.PREPARED):
        return _array_record_reader(info, split)
    return tfds_source.make_reader(info, split)


def _array_record_reader(info: registry.DatasetInfo, split: str):
    meta = records.read_meta(info.data_dir)
    shards = records.split_shards(info.data_dir, meta, split)
    shape = list(info.input_shape)
    if meta["encoding"] == "tensor":
        dtype = tf.as_dtype(meta["dtype"])
        size = int(np.prod(shape)) * dtype.size
        fetch = records.RecordReader(shards, record_bytes=size + 8)
        return lambda ids: _decode_rows(_fetch_rows(fetch, ids, size + 8), dtype, size, shape)
    fetch = records.RecordReader(shards)
    return lambda ids: _decode_images(_fetch(fetch, ids), shape)


def _fetch(fetch: records.RecordReader, ids) -> tf.Tensor:
    found = tf.numpy_function(fetch, [ids], tf.string, stateful=False)
    found.set_shape([None])
    return found


def _fetch_rows(fetch: records.RecordReader, ids, record_bytes: int) -> tf.Tensor:
    found = tf.numpy_function(fetch.rows, [ids], tf.uint8, stateful=False)
    found.set_shape([None, record_bytes])
    return found


def _decode_rows(rows: tf.Tensor, dtype: tf.DType, size: int, shape: list[int]):
    """Raw tensors and int64 labels from records of one size (the tensor's bytes, then its
    label, little-endian as the hosts TensorFlow runs on); uint8 images become float32 in
    [0, 1], as TFDS images do."""
    x = rows[:, :size]
    if dtype != tf.uint8:
        x = tf.bitcast(tf.reshape(x, [-1, size // dtype.size, dtype.size]), dtype)
    x = tf.reshape(x, [-1, *shape])
    y = tf.bitcast(tf.reshape(rows[:, size:], [-1, 8]), tf.int64)
    if dtype == tf.uint8:
        x = tf.cast(x, tf.float32) / 255.0
    return x, y


IMAGE_FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
}


def decode_image(encoded: tf.Tensor, shape: list[int]) -> tf.Tensor:
    """One JPEG, PNG, GIF or BMP image as float32 in [0, 1], resized to `shape` (H, W, C)."""
    image = tf.io.decode_image(encoded, channels=shape[2], expand_animations=False)
    image = tf.image.resize(tf.image.convert_image_dtype(image, tf.float32), shape[:2])
    return tf.ensure_shape(image, shape)


def _decode_images(found: tf.Tensor, shape: list[int]):
    examples = tf.io.parse_example(found, IMAGE_FEATURES)
    images = tf.map_fn(lambda e: decode_image(e, shape), examples["image/encoded"],
                       fn_output_signature=tf.TensorSpec(shape, tf.float32))
    return images, examples["image/class/label"]


def load_source(info: registry.DatasetInfo, split: str) -> tf.data.Dataset:
    """All `(x, y)` examples of `split`, in id order, unsharded (what `prepare` writes)."""
    if info.name in registry.OFFLINE:
        return tf.data.Dataset.from_tensor_slices(registry.OFFLINE[info.name][0](split))
    if info.name.startswith(registry.PREPARED):
        read = make_reader(info, split)
        return tf.data.Dataset.range(info.num_examples[split]).batch(256).map(read).unbatch()
    return tfds_source.load(info, split)
