"""`prepare`: write a dataset once as ArrayRecord shards that every worker reads by index.

Sources (`--dataset`):

- a registered dataset (`shapes`, `tokens`, a TFDS name): its examples as raw tensors;
- `tfrecord:DIR`: TFRecord files, one ArrayRecord file each, in order. Either a directory
  written by an earlier version's `prepare` (with its `dataset.json`), or files of
  `tf.train.Example`s with the common `image/encoded` and `image/class/label` features
  (files whose names start with `train` make the train split; `validation`, `val` or
  `test`, the test split), kept encoded;
- `images:DIR`: an image folder, one subfolder per class (what
  `keras.utils.image_dataset_from_directory` reads), either with `train/` and `test/` (or
  `validation/`) inside, or the class folders directly, of which a fixed fraction of the
  files, chosen by a hash of their path, is the test split. Every image is decoded once
  here, so that an unreadable one is named now; it is stored encoded.

Images are decoded and resized to `image_size` in each worker's input pipeline, for its
own examples only. Labels of class folders are the classes' indices in sorted order.
"""

import ctypes
import dataclasses
import errno
import hashlib
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError

from distrib_tf.data import readers
from distrib_tf.data import records
from distrib_tf.data import registry
from distrib_tf.keras import backup

IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
TEST_SPLIT_NAMES = ("test", "validation", "val")


def prepare(dataset: str, out_dir: str, *, num_shards: int = 8, data_dir: str | None = None,
            image_size: tuple[int, int] = (256, 256), test_fraction: float = 0.1) -> registry.DatasetInfo:
    """Writes `dataset` to `out_dir` as ArrayRecord shards and `dataset.json`; returns its info.

    Example:

        >>> info = prepare("shapes", "/tmp/shapes", num_shards=4)
        >>> info.name, info.num_examples["train"]
        ('array_record:/tmp/shapes', 8192)

    Raises:
        ValueError: a bad argument or an unreadable source (`records.DataError`), in one
            line naming the file.
    """
    if num_shards < 1:
        raise ValueError(f"Invalid value for `--num_shards`. Received: {num_shards}. Expected an integer >= 1.")
    if not 0 < test_fraction < 1:
        raise ValueError(f"Invalid value for `--test_fraction`. Received: {test_fraction}. "
                         "Expected a number between 0 and 1.")
    out_dir = os.path.normpath(out_dir)
    _check_out(out_dir)
    # Everything is written beside `out_dir` and renamed into place only when complete, so a
    # failed prepare leaves `out_dir` as it was, and `--out` may be the source itself (a
    # re-sharding, or converting an older format in place): it is read whole before it goes.
    staging = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)),
                               prefix=f".{os.path.basename(out_dir)}.preparing-")
    try:
        if dataset.startswith("images:"):
            meta = _from_image_folder(dataset[len("images:"):], staging, num_shards, image_size, test_fraction)
        elif dataset.startswith("tfrecord:"):
            meta = _from_tfrecords(dataset[len("tfrecord:"):], staging, image_size)
        else:
            meta = _from_registered(readers.load_info(dataset, data_dir=data_dir), staging, num_shards)
        records.write_meta(staging, {**meta, "format": "array_record"})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _replace_dir(staging, out_dir)
    return registry.prepared_info(out_dir)


def _check_out(out_dir: str) -> None:
    """Refuses an `--out` holding files that are not a prepared dataset's: it is replaced whole."""
    if not os.path.isdir(out_dir):
        if os.path.exists(out_dir):
            raise ValueError(f"Invalid value for `--out`. Received: {out_dir!r}, a file. Expected a directory.")
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        return
    if os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, records.META)):
        raise ValueError(f"Invalid value for `--out`. Received: {out_dir!r}, which holds files but no "
                         f"{records.META}. Expected a new or empty directory, or one that prepare wrote "
                         "(it is replaced whole).")


def _replace_dir(staging: str, out_dir: str) -> None:
    """`staging` becomes `out_dir`, synced to the disk first: a reader finds the earlier
    dataset or the new one, never none (one atomic exchange of the two directories, Linux's
    `renameat2(RENAME_EXCHANGE)`; where the file system has none, the earlier one is moved
    aside first, a moment without `out_dir`). The earlier one is then deleted."""
    for folder, _, files in os.walk(staging):
        for name in files:
            backup.fsync(os.path.join(folder, name))
        backup.fsync(folder)
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.exists(out_dir):
        os.rename(staging, out_dir)
    elif _exchange(staging, out_dir):
        shutil.rmtree(staging, ignore_errors=True)  # Now the earlier dataset.
    else:
        old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.replaced-")
        os.rename(out_dir, os.path.join(old, "dataset"))
        os.rename(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    backup.fsync(parent)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths at once (`renameat2` with `RENAME_EXCHANGE`); False where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), b)


# Registered datasets -----------------------------------------------------------------------

def _from_registered(info: registry.DatasetInfo, out_dir: str, num_shards: int) -> dict:
    batches = {split: readers.load_source(info, split).batch(1024).as_numpy_iterator() for split in records.SPLITS}
    return tensor_meta(info, out_dir, batches, num_shards=num_shards)


def tensor_meta(info: registry.DatasetInfo, out_dir: str, batches: dict, *, num_shards: int = 8,
                dtype: str | None = None) -> dict:
    """Writes `batches[split]`, an iterable of `(x, y)` arrays, as `tensor` shards; returns the meta.

    `info.num_examples` must give each split's total, so that each file holds a contiguous
    block of ids. `dtype`: of the stored tensors (default int32 for text, float32 for images;
    uint8 images are read as float32 in [0, 1]).
    """
    dtype = dtype or ("int32" if info.kind == "text" else "float32")
    files = {}
    for split in records.SPLITS:
        total = info.num_examples[split]
        writer, index = records.ShardWriter(out_dir, split, min(num_shards, total)), 0
        for x, y in batches[split]:
            for row, label in zip(np.asarray(x, dtype), np.asarray(y)):
                writer.write(tensor_record(row, label), records.shard_of(index, total, len(writer.counts)))
                index += 1
        files[split] = writer.close()
    return meta_of(info, files, encoding="tensor", dtype=dtype)


def write_arrays(out_dir: str, info: registry.DatasetInfo, arrays: dict, *, num_shards: int = 1) -> str:
    """Writes `arrays[split] = (x, y)` as a prepared dataset; returns its `--dataset` name."""
    os.makedirs(out_dir, exist_ok=True)
    info = dataclasses.replace(info, num_examples={split: len(arrays[split][1]) for split in records.SPLITS})
    meta = tensor_meta(info, out_dir, {split: [arrays[split]] for split in records.SPLITS}, num_shards=num_shards)
    records.write_meta(out_dir, {**meta, "format": "array_record"})
    return f"{registry.PREPARED}{out_dir}"


def tensor_record(x: np.ndarray, label) -> bytes:
    """The `tensor` encoding: raw little-endian bytes of `x`, then the label as int64."""
    little = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<"))
    return little.tobytes() + np.int64(label).astype("<i8").tobytes()


def meta_of(info: registry.DatasetInfo, files: dict, **fields) -> dict:
    """`dataset.json` for `info` and the `files` of each split (`records.ShardWriter.close()`)."""
    return {"name": info.name, "kind": info.kind, "num_classes": info.num_classes,
            "input_shape": list(info.input_shape), "vocab_size": info.vocab_size,
            "num_examples": {split: sum(f["num_records"] for f in files[split]) for split in files},
            "files": files, **fields}


def image_record(encoded: bytes, label: int) -> bytes:
    """The `image` encoding: a `tf.train.Example` with `image/encoded` and `image/class/label`."""
    feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
               "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# Image folders -------------------------------------------------------------------------------

def _image_files(root: str) -> list[tuple[str, str]]:
    """`(class, path)` of every image under `root/<class>/`, sorted."""
    if not os.path.isdir(root):
        raise records.DataError(f"Invalid value for `--dataset`. Received: images:{root}. Expected a directory "
                                "with one subfolder of images per class.")
    found = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if os.path.isdir(folder):
            for dirpath, _, filenames in sorted(os.walk(folder)):
                found += [(name, os.path.join(dirpath, f)) for f in sorted(filenames)
                          if f.lower().endswith(IMAGE_EXTENSIONS)]
    return found


def _from_image_folder(root: str, out_dir: str, num_shards: int, image_size, test_fraction: float) -> dict:
    test_dir = next((os.path.join(root, n) for n in TEST_SPLIT_NAMES if os.path.isdir(os.path.join(root, n))), None)
    if os.path.isdir(os.path.join(root, "train")) and test_dir:
        splits = {"train": _image_files(os.path.join(root, "train")), "test": _image_files(test_dir)}
    else:
        every = _image_files(root)
        in_test = [int(hashlib.blake2b(os.path.relpath(p, root).encode(), digest_size=8).hexdigest(), 16)
                   % 10_000 < test_fraction * 10_000 for _, p in every]
        splits = {"train": [f for f, t in zip(every, in_test) if not t],
                  "test": [f for f, t in zip(every, in_test) if t]}
    classes = sorted({name for name, _ in splits["train"]})
    for split, found in splits.items():
        if not found:
            raise records.DataError(f"No images for the {split} split under {root}. Expected files ending in "
                                    f"{', '.join(IMAGE_EXTENSIONS)} in one subfolder per class.")
    unknown = sorted({name for name, _ in splits["test"]} - set(classes))
    if unknown:
        raise records.DataError(f"The test split under {root} has classes the train split lacks: {unknown}.")
    files = {}
    for split, found in splits.items():
        writer = records.ShardWriter(out_dir, split, min(num_shards, len(found)))
        for index, (name, path) in enumerate(found):
            writer.write(image_record(_checked_image(path), classes.index(name)),
                         records.shard_of(index, len(found), len(writer.counts)))
        files[split] = writer.close()
    info = registry.DatasetInfo(f"images:{root}", "image", len(classes), (*image_size, 3))
    return meta_of(info, files, encoding="image", classes=classes)


def _checked_image(path: str) -> bytes:
    with open(path, "rb") as f:
        encoded = f.read()
    try:
        tf.io.decode_image(encoded, channels=3, expand_animations=False)
    except (tf.errors.InvalidArgumentError, tf.errors.UnknownError) as e:
        raise records.DataError(f"Cannot decode image {path} ({len(encoded)} bytes): "
                                f"{e.message.splitlines()[0][:120]}. Expected a JPEG, PNG, GIF or BMP file.") from e
    return encoded


# TFRecord files ---------------------------------------------------------------------------

def _tfrecord_splits(root: str) -> dict[str, list[str]]:
    if not os.path.isdir(root):
        raise records.DataError(f"Invalid value for `--dataset`. Received: tfrecord:{root}. Expected a directory "
                                "of TFRecord files.")
    names = sorted(f for f in os.listdir(root) if os.path.isfile(os.path.join(root, f)) and f != records.META)
    splits = {"train": [os.path.join(root, f) for f in names if f.startswith("train")],
              "test": [os.path.join(root, f) for f in names if f.startswith(TEST_SPLIT_NAMES)]}
    for split, found in splits.items():
        if not found:
            raise records.DataError(f"No {split} files in {root}. Expected TFRecord files named "
                                    f"{'train*' if split == 'train' else 'test*, validation* or val*'}.")
    return splits


def _from_tfrecords(root: str, out_dir: str, image_size) -> dict:
    splits = _tfrecord_splits(root)
    legacy = os.path.exists(os.path.join(root, records.META))  # An earlier version's `prepare`.
    old = _legacy_meta(root) if legacy else None
    files, labels = {}, set()
    for split, inputs in splits.items():
        writer = records.ShardWriter(out_dir, split, len(inputs))
        for shard, path in enumerate(inputs):
            for position, raw in enumerate(_tfrecord_iterator(path)):
                try:
                    record, label = _legacy_record(raw, old) if legacy else _image_example(raw)
                except (ValueError, DecodeError, tf.errors.OpError) as e:
                    message = getattr(e, "message", str(e)).splitlines()[0][:120]
                    raise records.DataError(f"Record {position} of {path} does not parse ({message}). Expected "
                                            + ("the tensor records of its dataset.json." if legacy else
                                               "a tf.train.Example with image/encoded and image/class/label.")) from e
                labels.add(label)
                writer.write(record, shard)
        files[split] = writer.close()
    if legacy:
        info = registry.DatasetInfo(old["name"], old["kind"], old["num_classes"], tuple(old["input_shape"]),
                                    vocab_size=old.get("vocab_size", 0))
        return meta_of(info, files, encoding="tensor", dtype="int32" if old["kind"] == "text" else "float32")
    info = registry.DatasetInfo(f"tfrecord:{root}", "image", max(labels) + 1, (*image_size, 3))
    return meta_of(info, files, encoding="image")


def _tfrecord_iterator(path: str):
    try:
        yield from tf.data.TFRecordDataset(path).as_numpy_iterator()
    except tf.errors.DataLossError as e:
        raise records.DataError(f"Cannot read {path}: {e.message.splitlines()[0][:120]} "
                                "(truncated or not a TFRecord file).") from e


def _image_example(raw: bytes) -> tuple[bytes, int]:
    example = tf.train.Example.FromString(raw)
    feature = example.features.feature
    if "image/encoded" not in feature or "image/class/label" not in feature:
        raise ValueError(f"features {sorted(feature)[:6]}")
    label = feature["image/class/label"].int64_list.value
    encoded = feature["image/encoded"].bytes_list.value
    if len(label) != 1 or len(encoded) != 1 or label[0] < 0:
        raise ValueError("one image/encoded and one image/class/label >= 0 expected")
    return image_record(encoded[0], label[0]), int(label[0])


def _legacy_meta(root: str) -> dict:
    """An earlier version's `dataset.json`, with what converting it needs checked: one line each."""
    old, path = records.read_meta(root), os.path.join(root, records.META)
    if old.get("kind") not in ("image", "text"):
        raise records.DataError(f"Invalid value for `kind` in {path}. Received: {old.get('kind')!r}. "
                                "Expected 'image' or 'text'.")
    shape = old.get("input_shape")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise records.DataError(f"Invalid value for `input_shape` in {path}. Received: {shape!r}. Expected a "
                                "list of positive integers.")
    if not isinstance(old.get("num_classes"), int) or old["num_classes"] < 1:
        raise records.DataError(f"Invalid value for `num_classes` in {path}. Received: {old.get('num_classes')!r}. "
                                "Expected an integer >= 1.")
    return {"name": old.get("name", f"tfrecord:{root}"), **old}


def _legacy_record(raw: bytes, old: dict) -> tuple[bytes, int]:
    parsed = tf.io.parse_single_example(raw, {"x": tf.io.FixedLenFeature([], tf.string),
                                              "y": tf.io.FixedLenFeature([], tf.int64)})
    dtype = tf.int32 if old["kind"] == "text" else tf.float32
    x = tf.ensure_shape(tf.io.parse_tensor(parsed["x"], dtype), old["input_shape"]).numpy()
    return tensor_record(x, int(parsed["y"])), int(parsed["y"])
