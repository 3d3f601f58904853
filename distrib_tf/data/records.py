"""Prepared datasets on disk: ArrayRecord shards and the `dataset.json` that describes them.

A prepared directory holds, per split, ArrayRecord files (`train-00000-of-00008.array_record`,
written with `group_size:1` so that any record is read alone) and one `dataset.json`,
written last:

    {"name": ..., "kind": "image", "num_classes": 10, "input_shape": [28, 28, 1],
     "vocab_size": 0, "num_examples": {"train": 8192, "test": 2048},
     "format": "array_record", "encoding": "tensor", "dtype": "float32",
     "files": {"train": [{"path": "train-00000-of-00008.array_record", "num_records": 1024}, ...],
               "test": [...]}}

Example id `k` of a split is record `k` of its files taken in order. Two encodings:

- `tensor`: a record is the example's raw bytes (`dtype`, `input_shape`, little-endian)
  followed by its label as a little-endian int64; decoded in the graph, a batch at a time;
- `image`: a record is a serialized `tf.train.Example` with `image/encoded` (JPEG, PNG,
  GIF or BMP bytes) and `image/class/label`; decoded and resized to `input_shape` in the
  graph, on the worker that trains on it.

`load_meta` checks the directory before anything trains: every file there, readable, with
the number of records `dataset.json` says. Every mistake is one line naming the file.
"""

import atexit
import contextlib
import dataclasses
import json
import os
import re
import threading
import time
import weakref

import numpy as np
from array_record.python import array_record_module

META = "dataset.json"
SPLITS = ("train", "test")
ENCODINGS = ("tensor", "image")
TENSOR_DTYPES = ("float32", "float16", "uint8", "int32", "int64")
WRITER_OPTIONS = "group_size:1"  # Each record its own chunk: random access reads one record.


class DataError(ValueError):
    """A prepared dataset that cannot be read as `dataset.json` describes it."""


def data_error_in(error: BaseException) -> str | None:
    """The message of a `DataError` raised inside an input pipeline, from the error TensorFlow raised."""
    match = re.search(r"DataError: ([^\n]+)", str(error))
    return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class Shards:
    """The files of one split, in id order, with their record counts."""

    paths: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def num_records(self) -> int:
        return sum(self.counts)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The file index and the position in that file of each example id."""
        ends = np.cumsum(self.counts)
        files = np.searchsorted(ends, ids, side="right")
        return files, ids - (ends[files] - np.asarray(self.counts)[files])


def _invalid(path: str, field: str, received, expected: str) -> DataError:
    return DataError(f"Invalid value for `{field}` in {path}. Received: {received!r}. Expected {expected}.")


def read_meta(directory: str) -> dict:
    """`dataset.json` of a prepared directory, as it is (`load_meta` checks it)."""
    path = os.path.join(directory, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError as e:
        raise DataError(f"No {META} in {directory}. Expected a directory written by "
                        "`python -m distrib_tf.data prepare --dataset=NAME --out=DIR`.") from e
    except (OSError, ValueError) as e:
        raise DataError(f"Cannot read {path}: {e}.") from e
    if not isinstance(meta, dict):
        raise _invalid(path, "dataset.json", type(meta).__name__, "a JSON object")
    return meta


def load_meta(directory: str) -> dict:
    """`dataset.json` of a prepared directory, checked against the files it names.

    Raises:
        DataError: the file is missing or malformed, or a shard is missing, unreadable
            (truncated, not ArrayRecord) or holds another number of records.
    """
    meta, path = read_meta(directory), os.path.join(directory, META)
    if meta.get("format") != "array_record":
        raise _invalid(path, "format", meta.get("format"), "'array_record' (TFRecord directories: convert them "
                       f"with `python -m distrib_tf.data prepare --dataset=tfrecord:{directory} --out=DIR`)")
    if meta.get("encoding") not in ENCODINGS:
        raise _invalid(path, "encoding", meta.get("encoding"), f"one of {', '.join(ENCODINGS)}")
    if meta.get("kind") not in ("image", "text"):
        raise _invalid(path, "kind", meta.get("kind"), "'image' or 'text'")
    if not isinstance(meta.get("num_classes"), int) or meta["num_classes"] < 1:
        raise _invalid(path, "num_classes", meta.get("num_classes"), "an integer >= 1")
    shape = meta.get("input_shape")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise _invalid(path, "input_shape", shape, "a list of positive integers")
    if meta["encoding"] == "tensor" and meta.get("dtype") not in TENSOR_DTYPES:
        raise _invalid(path, "dtype", meta.get("dtype"), f"one of {', '.join(TENSOR_DTYPES)}")
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != set(SPLITS):
        raise _invalid(path, "files", files if not isinstance(files, dict) else sorted(files),
                       f"an object with the splits {', '.join(SPLITS)}")
    if not isinstance(meta.get("num_examples"), dict):
        raise _invalid(path, "num_examples", meta.get("num_examples"),
                       f"an object giving each split's examples ({', '.join(SPLITS)})")
    for split in SPLITS:
        shards = split_shards(directory, meta, split)
        if shards.num_records != meta.get("num_examples", {}).get(split):
            raise _invalid(path, f"num_examples.{split}", meta.get("num_examples", {}).get(split),
                           f"{shards.num_records}, the records listed in `files.{split}`")
        for shard, count in zip(shards.paths, shards.counts):
            check_shard(shard, count)
    return meta


def split_shards(directory: str, meta: dict, split: str) -> Shards:
    path = os.path.join(directory, META)
    entries = meta["files"][split]
    if not isinstance(entries, list) or not entries:
        raise _invalid(path, f"files.{split}", entries, "a non-empty list of {path, num_records}")
    paths, counts = [], []
    for i, entry in enumerate(entries):
        if (not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or os.sep in entry["path"]
                or not isinstance(entry.get("num_records"), int) or entry["num_records"] < 0):
            raise _invalid(path, f"files.{split}[{i}]", entry,
                           "{\"path\": a file name in this directory, \"num_records\": an integer >= 0}")
        paths.append(os.path.join(directory, entry["path"]))
        counts.append(entry["num_records"])
    return Shards(tuple(paths), tuple(counts))


def check_shard(path: str, expected: int) -> None:
    """Raises `DataError` unless `path` is a readable ArrayRecord file of `expected` records."""
    if not os.path.isfile(path):
        raise DataError(f"Missing shard {path}, listed in {os.path.join(os.path.dirname(path), META)}.")
    try:
        reader = array_record_module.ArrayRecordReader(path)
        found = reader.num_records()
        reader.close()
    except Exception as e:  # pylint: disable=broad-except  (riegeli's errors are plain RuntimeErrors)
        first = next(iter(str(e).strip().splitlines()), type(e).__name__)
        raise DataError(f"Cannot read shard {path} ({os.path.getsize(path)} bytes): truncated or not an "
                        f"ArrayRecord file ({first[:160]}).") from e
    if found != expected:
        raise DataError(f"Shard {path} holds {found} records; "
                        f"{os.path.join(os.path.dirname(path), META)} says {expected}.")


class ExitGuard:
    """Keeps a `tf.numpy_function` of an input pipeline from running while Python exits.

    tf.data calls such functions from its own threads. A pipeline still prefetching when a
    script ends was destroyed during the interpreter's finalization, with calls waiting
    for Python: the process aborted or hung. At exit (`atexit`) every guard refuses new
    calls, which then fail at once (a pipeline stops calling once its buffers hold the
    failures), waits until calls have stopped coming, and runs `on_close`.
    """

    def __init__(self, on_close=None):
        self._on_close, self._lock = on_close, threading.Condition()
        self._active, self._closed, self._last_call = 0, False, 0.0
        _GUARDS.add(self)

    @contextlib.contextmanager
    def call(self):
        with self._lock:
            self._last_call = time.monotonic()
            if self._closed:
                raise DataError("The process is exiting: its input pipelines are closed.")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            while time.monotonic() < deadline:
                self._lock.wait_for(lambda: self._active == 0, max(deadline - time.monotonic(), 0))
                quiet = time.monotonic() - self._last_call
                if quiet >= _QUIET:
                    break
                self._lock.wait(_QUIET - quiet)
            if self._on_close:
                self._on_close()


_GUARDS: "weakref.WeakSet[ExitGuard]" = weakref.WeakSet()
_QUIET = 0.2  # Seconds without a call after which a closing guard's pipelines are taken as stopped.


@atexit.register
def _close_guards() -> None:
    for guard in list(_GUARDS):
        guard.close()
    _close_files()


class RecordReader:
    """Reads records of one split by example id, a batch at a time.

    Each record is read alone, as a range of one (`read(p, p + 1)`), in the ids' order:
    array_record's `read(indices)` walks every chunk of the file on each call (one chunk a
    record here) and fans out to a pool of 64 spinning threads; a range of one record is
    read in place, the GIL released, through a 16 KiB file buffer: one core went from 24,249
    to 78,224 records/s (`make bench-data`, BENCHMARKS.md).

    The files are opened on first use, once per process whatever the number of pipelines
    (each `fit`, validation and evaluate builds its own); tf.data runs several batches at
    once. At exit the files are closed (`ExitGuard`).
    """

    def __init__(self, shards: Shards, *, record_bytes: int | None = None):
        self.shards, self.record_bytes = shards, record_bytes
        self._guard = ExitGuard()

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """The records with those ids, as an object array of `bytes` (records of any size)."""
        *_, read = self._read(ids)
        found = np.empty(len(read), dtype=object)
        found[:] = read
        return found

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The records with those ids as the rows of one `[len(ids), record_bytes]` uint8 array.

        For records of one size (`tensor` encoding): numbers, not strings, for the graph to
        slice; one copy beyond the reader's own (the join).
        """
        files, positions, read = self._read(ids)
        joined = b"".join(read)
        if len(joined) != len(read) * self.record_bytes:
            row = next(i for i, record in enumerate(read) if len(record) != self.record_bytes)
            raise DataError(f"Record {positions[row]} of {self.shards.paths[files[row]]} has {len(read[row])} bytes. "
                            f"Expected {self.record_bytes}: the shard changed after prepare.")
        return np.frombuffer(joined, dtype=np.uint8).reshape(len(read), self.record_bytes)

    def _read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        files, positions = self.shards.locate(np.asarray(ids, dtype=np.int64))
        with self._guard.call():
            readers = {f: _open(self.shards.paths[f]) for f in set(files.tolist())}
            read = [readers[f].read(p, p + 1)[0] for f, p in zip(files.tolist(), positions.tolist())]
        return files, positions, read


_FILES: dict = {}  # Path: its ArrayRecordReader, shared by every pipeline of the process.
_FILES_LOCK = threading.Lock()


def _open(path: str):
    with _FILES_LOCK:
        if path not in _FILES:  # Options as for random access (array_record's data source).
            _FILES[path] = array_record_module.ArrayRecordReader(
                path, "readahead_buffer_size:0", file_reader_buffer_size=16384)
        return _FILES[path]


def _close_files() -> None:
    with _FILES_LOCK:
        for reader in _FILES.values():
            reader.close()
        _FILES.clear()


class ShardWriter:
    """Writes one split to `num_shards` files; example ids follow the files' order.

    `write(record, shard)` appends to file `shard`: give contiguous blocks of examples to
    each file (`shard_of`) so that id `k` is the source's `k`-th example.
    """

    def __init__(self, directory: str, split: str, num_shards: int):
        self.names = [f"{split}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)]
        self._paths = [os.path.join(directory, name) for name in self.names]
        self._writers = [array_record_module.ArrayRecordWriter(p + ".writing", WRITER_OPTIONS) for p in self._paths]
        self.counts = [0] * num_shards

    def write(self, record: bytes, shard: int) -> None:
        self._writers[shard].write(record)
        self.counts[shard] += 1

    def close(self) -> list[dict]:
        for writer, path in zip(self._writers, self._paths):
            writer.close()
            os.replace(path + ".writing", path)
        return [{"path": name, "num_records": count} for name, count in zip(self.names, self.counts)]


def shard_of(index: int, total: int, num_shards: int) -> int:
    """The file of example `index` of `total` when each file holds a contiguous block."""
    return index * num_shards // total


def write_meta(directory: str, meta: dict) -> None:
    """`dataset.json`, written last and atomically: a directory without it is not prepared."""
    path = os.path.join(directory, META)
    with open(path + ".writing", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(path + ".writing", path)
