"""Datasets, the order and the readers: offline defaults, TFDS (mocked and prepared), ArrayRecord shards."""

import hashlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from array_record.python import array_record_module

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from distrib_tf import data
from distrib_tf.data import order
from distrib_tf.data import records
from distrib_tf.data import tfds_source

HERE = os.path.dirname(__file__)
ENV = {"PYTHONPATH": os.path.dirname(HERE)}


def _digest(row):
    return hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest()


def _fingerprints(dataset, steps):
    seen = []
    for x, _ in dataset.take(steps):
        seen += [_digest(row) for row in x.numpy()]
    return seen


@pytest.mark.parametrize("name, shape, classes", [("shapes", (28, 28, 1), 10), ("tokens", (64,), 4)])
def test_offline_defaults_are_fixed_and_balanced(name, shape, classes):
    info = data.load_info(name)
    assert info.input_shape == shape and info.num_classes == classes
    first = list(data.load_source(info, "test").take(3).as_numpy_iterator())
    again = list(data.load_source(info, "test").take(3).as_numpy_iterator())
    for (x1, y1), (x2, y2) in zip(first, again):
        np.testing.assert_array_equal(x1, x2)
        assert y1 == y2
    labels = np.array([y for _, y in data.load_source(info, "train").as_numpy_iterator()])
    assert len(labels) == info.num_examples["train"]
    assert np.bincount(labels).min() > 0.7 * len(labels) / classes


@pytest.mark.parametrize("name, kind, shape", [
    ("mnist", "image", (28, 28, 1)),
    ("fashion_mnist", "image", (28, 28, 1)),
    ("cifar10", "image", (32, 32, 3)),
    ("imdb_reviews", "text", (data.TEXT_SEQ_LEN,)),
])
def test_tfds_datasets_through_mock_data(name, kind, shape):
    with tfds.testing.mock_data(num_examples=64):
        info = data.load_info(name)
        assert info.kind == kind and info.input_shape == shape
        dataset = data.make_dataset_fn(info, "train", global_batch_size=8)(tf.distribute.InputContext())
        x, y = next(iter(dataset))
    assert x.shape == (8, *shape) and y.shape == (8,)
    if kind == "text":
        assert x.dtype == tf.int32 and int(tf.reduce_max(x)) < data.TEXT_VOCAB_SIZE
    else:
        assert 0.0 <= float(tf.reduce_min(x)) and float(tf.reduce_max(x)) <= 1.0


class DtfTinyImages(tfds.core.GeneratorBasedBuilder):
    """A real TFDS dataset prepared offline: example i is an image of value i, label i % 10."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(28, 28, 1)),
                                               "label": tfds.features.ClassLabel(num_classes=10)})
        return tfds.core.DatasetInfo(builder=self, supervised_keys=("image", "label"), features=features)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 96), "test": self._generate_examples(96, 128)}

    def _generate_examples(self, start, stop):
        for i in range(start, stop):
            yield i, {"image": np.full((28, 28, 1), i, np.uint8), "label": i % 10}


def _values(batch):
    return [int(round(float(x[0, 0, 0]) * 255)) for x in batch]


def test_a_tfds_dataset_in_array_record_is_read_by_index(tmp_path):
    """Each of two pipelines reads only its replicas' examples; together they are the one-process
    global batches; an epoch is a permutation of the split; TFRecord-prepared data is refused."""
    DtfTinyImages(data_dir=str(tmp_path / "ar"), file_format="array_record").download_and_prepare()
    info = tfds_source.load_info("dtf_tiny_images", str(tmp_path / "ar"))
    assert info.num_examples == {"train": 96, "test": 32}
    dataset_fn = data.make_dataset_fn(info, "train", global_batch_size=12)  # 8 steps an epoch.
    one = [_values(x) for x, _ in dataset_fn(tf.distribute.InputContext()).take(16)]
    assert sorted(sum(one[:8], [])) == list(range(96)) and one[:8] != one[8:]  # Permuted, reshuffled.
    halves = [[_values(x) for x, _ in dataset_fn(tf.distribute.InputContext(2, i, 4)).take(32)] for i in (0, 1)]
    for step, expected in enumerate(one):
        got = sum((halves[p][2 * step + r] for p in (0, 1) for r in (0, 1)), [])
        assert got == expected
    DtfTinyImages(data_dir=str(tmp_path / "tfrecord")).download_and_prepare()
    streamed = tfds_source.load_info("dtf_tiny_images", str(tmp_path / "tfrecord"))
    with pytest.raises(ValueError, match=r"cannot be read by index .* `python -m distrib_tf.data prepare "
                                         r"--dataset=dtf_tiny_images --data_dir=.* --out=DIR` converts it once"):
        data.check_random_access(streamed)


def test_tfds_not_prepared_names_dataset_dir_and_command(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        data.load_info("mnist", data_dir=str(tmp_path))
    message = str(error.value)
    assert "\n" not in message
    assert f"Dataset 'mnist' is not prepared in data_dir={tmp_path}" in message
    assert f"tfds.load('mnist', data_dir='{tmp_path}')" in message


def test_unknown_dataset_and_bad_batch():
    message = r"Invalid value for `--dataset`\. Received: 'imagenet'\. Expected one of shapes, tokens, mnist"
    with pytest.raises(ValueError, match=r"Received: 'tfrecord:/data', which has no random access\. .*"
                                         r"`python -m distrib_tf.data prepare --dataset=tfrecord:/data --out=DIR`"):
        data.load_info("tfrecord:/data")
    with pytest.raises(ValueError, match=message):
        data.load_info("imagenet")
    with pytest.raises(ValueError, match=r"Received: 10\. Expected a multiple of the 4 replicas, such as 8\."):
        data.check_global_batch_size(10, 4)
    with pytest.raises(ValueError, match=r"Received: 0\. Expected a positive integer"):
        data.check_global_batch_size(0, 1)


@pytest.fixture(scope="module")
def prepared_shapes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shapes"))
    assert data.main(["prepare", "--dataset=shapes", f"--out={out}", "--num_shards=4"]) == 0
    return data.load_info(f"array_record:{out}")


def test_prepared_shards_hold_the_examples_in_id_order(prepared_shapes):
    assert prepared_shapes.num_examples == data.load_info("shapes").num_examples
    assert len([f for f in os.listdir(prepared_shapes.data_dir) if f.startswith("train-")]) == 4
    for split in ("train", "test"):
        original = _fingerprints(data.load_source(data.load_info("shapes"), split).batch(512), 4)
        assert _fingerprints(data.load_source(prepared_shapes, split).batch(512), 4) == original


@pytest.mark.parametrize("pipelines, replicas, start_step", [(1, 1, 0), (2, 4, 0), (1, 2, 125)])
def test_a_streamed_copy_gives_the_in_memory_batches_byte_for_byte(prepared_shapes, pipelines, replicas,
                                                                    start_step):
    """The same order for data held in memory and data read by index from disk."""
    def batches(info, index):
        dataset_fn = data.make_dataset_fn(info, "train", global_batch_size=64, seed=5, start_step=start_step)
        return list(dataset_fn(tf.distribute.InputContext(pipelines, index, replicas)).take(12).as_numpy_iterator())

    for index in range(pipelines):
        for (x1, y1), (x2, y2) in zip(batches(data.load_info("shapes"), index), batches(prepared_shapes, index)):
            assert x1.tobytes() == x2.tobytes() and y1.tobytes() == y2.tobytes()


def test_the_reader_gives_each_id_its_own_record_across_files_in_any_order(prepared_shapes):
    """`RecordReader` against each file read on its own, record by record: ids from every
    shard, out of order, repeated, as rows (`tensor` encoding) and as strings."""
    shards = records.split_shards(prepared_shapes.data_dir, records.read_meta(prepared_shapes.data_dir), "train")
    expected = []
    for path in shards.paths:
        reader = array_record_module.ArrayRecordReader(path)
        expected += reader.read_all()
        reader.close()
    ends = np.cumsum(shards.counts)
    ids = np.array([ends[-1] - 1, 0, ends[0], ends[0] - 1, 7, 7, ends[1] + 3, ends[2]], dtype=np.int64)
    reader = records.RecordReader(shards, record_bytes=len(expected[0]))
    assert [row.tobytes() for row in reader.rows(ids)] == [expected[i] for i in ids]
    assert list(reader(ids)) == [expected[i] for i in ids]


def _ids(pipelines, replicas, *, n, batch, seed=3, start_step=0, steps):
    """Global batches of ids, step by step, put together from every pipeline of a layout."""
    local = replicas // pipelines
    per_pipeline = [list(order.replica_batches(
        num_examples=n, steps_per_epoch=n // batch, global_batch_size=batch, replicas=replicas,
        pipeline=(index, pipelines), seed=seed, start_step=start_step).take(steps * local).as_numpy_iterator())
        for index in range(pipelines)]
    return [np.concatenate([per_pipeline[p][s * local + r] for p in range(pipelines) for r in range(local)])
            for s in range(steps)]


@pytest.mark.parametrize("n, batch", [(64, 4), (100, 8), (1000, 16)])
def test_the_order_is_a_permutation_the_same_for_every_layout_and_resume(n, batch):
    """No training: the ids alone. Each epoch's positions map to a permutation of the
    examples; every layout gives the same global batches over 2 epochs; a resume at step s
    equals the uninterrupted stream from s."""
    steps = n // batch
    reference = _ids(1, 1, n=n, batch=batch, steps=2 * steps)
    for epoch in (0, 1):
        every = order.example_ids(tf.range(n), epoch, num_examples=n, seed=3, shuffle=True).numpy()
        assert sorted(every) == list(range(n))
        trained = np.concatenate(reference[epoch * steps:(epoch + 1) * steps])
        np.testing.assert_array_equal(trained, every[:steps * batch])
    assert not np.array_equal(reference[0], reference[steps])  # Each epoch its own order.
    for pipelines, replicas in [(1, 2), (2, 2), (2, 4), (4, 4)]:
        layout = _ids(pipelines, replicas, n=n, batch=batch, steps=2 * steps)
        for expected, got in zip(reference, layout):
            np.testing.assert_array_equal(got, expected)
    for start in (1, steps - 1, steps, steps + 3):
        resumed = _ids(2, 4, n=n, batch=batch, start_step=start, steps=4)
        for expected, got in zip(reference[start:], resumed):
            np.testing.assert_array_equal(got, expected)
    test_order = order.example_ids(tf.range(n), 7, num_examples=n, seed=3, shuffle=False).numpy()
    np.testing.assert_array_equal(test_order, np.arange(n))  # The test split keeps its order.


@pytest.mark.multiworker
def test_two_workers_see_every_example_once_per_epoch(tmp_path):
    check_ok(run_cluster([os.path.join(HERE, "workers", "shards.py"), "tokens", 64, tmp_path],
                         spec=local_spec(2), env=ENV, timeout=120))
    views = []
    for task in ("worker_0", "worker_1"):
        with open(tmp_path / f"{task}.json") as f:
            views.append(json.load(f))
    assert views[0]["steps"] == views[1]["steps"] == 8192 // 64
    first, second = set(views[0]["seen"]), set(views[1]["seen"])
    assert len(first) == len(views[0]["seen"]) == 4096 and len(second) == 4096
    assert not first & second
    expected = {_digest(x) for x, _ in data.load_source(data.load_info("tokens"), "train").as_numpy_iterator()}
    assert first | second == expected


# The process's own peak (VmHWM): getrusage's ru_maxrss keeps the parent's peak across exec,
# so a worker started by this test process reported the test's 2.25 GB as its own.
# Printed at the end, whichever way the task leaves: a job of several workers leaves through
# `os._exit` (`distrib_tf.run.ending.leave_together`), without `atexit`.
PEAK_RSS = ("import atexit, os, re, runpy, sys; "
            "peak = lambda: print('peak_rss_kib', re.search(r'VmHWM:\\s+(\\d+)', "
            "open('/proc/self/status').read()).group(1), flush=True); "
            "atexit.register(peak); leave = os._exit; os._exit = lambda code: (peak(), leave(code)); "
            "sys.argv = ['distrib_tf.train', *sys.argv[1:]]; runpy.run_module('distrib_tf.train', run_name='__main__')")


def _synthetic(out, gigabytes, shards):
    """Random 64x64x3 uint8 images in `tensor` records, written in 1024-example batches."""
    from distrib_tf.data import prepare  # pylint: disable=import-outside-toplevel

    count = int(gigabytes * 2**30 / (64 * 64 * 3 + 8))
    os.makedirs(out)
    info = data.DatasetInfo("synthetic", "image", 10, (64, 64, 3), num_examples={"train": count, "test": 1024})
    rng = np.random.default_rng(0)

    def batches(total):
        for start in range(0, total, 1024):
            yield rng.integers(0, 256, (min(1024, total - start), 64, 64, 3), np.uint8), rng.integers(0, 10, 1024)

    meta = prepare.tensor_meta(info, str(out), {split: batches(n) for split, n in info.num_examples.items()},
                               num_shards=shards, dtype="uint8")
    records.write_meta(str(out), {**meta, "format": "array_record"})
    return f"array_record:{out}"


def _peak_rss(dataset, model_dir):
    results = check_ok(run_cluster(["-c", PEAK_RSS, f"--dataset={dataset}", "--epochs=1", "--steps_per_epoch=50",
                                    "--global_batch_size=32", f"--model_dir={model_dir}"],
                                   spec=local_spec(2), env=ENV, timeout=1800))
    return [int(re.search(r"peak_rss_kib (\d+)", r.output).group(1)) * 1024 for r in results]


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_dataset_larger_than_memory_trains_with_the_memory_of_a_small_one(tmp_path):
    """More bytes on disk than this machine has RAM: 50 steps on 2 workers, each worker's peak
    memory within 256 MiB of the same job on a 1 GiB dataset."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    large = memory / 2**30 + 2
    free = shutil.disk_usage(tmp_path).free / 2**30
    assert free > large + 8, f"needs {large + 8:.0f} GiB free in {tmp_path}, has {free:.0f}"
    small_rss = _peak_rss(_synthetic(tmp_path / "small", 1, 8), tmp_path / "small_run")
    shutil.rmtree(tmp_path / "small")
    large_dataset = _synthetic(tmp_path / "large", large, 64)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "large").iterdir())
    assert on_disk > memory, (on_disk, memory)
    large_rss = _peak_rss(large_dataset, tmp_path / "large_run")
    print(f"{on_disk / 2**30:.1f} GiB on disk, {memory / 2**30:.1f} GiB of RAM: peak RSS per worker "
          f"{[round(r / 2**20) for r in large_rss]} MiB against {[round(r / 2**20) for r in small_rss]} MiB on 1 GiB")
    report = os.environ.get("DISTRIB_TF_SOAK_REPORT")
    if report:
        with open(report + ".data.json", "w") as f:
            json.dump({"bytes_on_disk": on_disk, "memory": memory, "peak_rss_large": large_rss,
                       "peak_rss_1gib": small_rss}, f)
    for big, small in zip(large_rss, small_rss):
        assert big <= small + 256 * 2**20, (large_rss, small_rss)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_an_epoch_of_uneven_steps_reads_every_example_once_in_shares_one_apart(replicas):
    """Keras's steps: 11 examples in batches of 5 are steps of 5, 5 and 1; each step's rows
    split over the replicas in shares at most one apart (empty ones where rows are fewer),
    and each epoch, shuffled, reads every example once."""
    ids = list(order.replica_batches(num_examples=11, steps_per_epoch=3, global_batch_size=5, replicas=replicas,
                                     seed=3).take(2 * 3 * replicas).as_numpy_iterator())
    steps = [ids[s * replicas:(s + 1) * replicas] for s in range(6)]
    assert [sum(len(share) for share in step) for step in steps] == [5, 5, 1] * 2
    assert all(max(map(len, step)) - min(map(len, step)) <= 1 for step in steps)
    for epoch in (0, 1):
        assert sorted(np.concatenate([i for step in steps[3 * epoch:3 * epoch + 3] for i in step])) == list(range(11))
