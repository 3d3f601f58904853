"""Datasets and sharded pipelines: offline defaults, TFDS (mocked data), TFRecord shards."""

import hashlib
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from distrib_tf import data

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


def test_each_tfds_pipeline_reads_only_its_part_of_the_split(tmp_path):
    """Two input pipelines of a prepared TFDS dataset: disjoint halves, each shuffled, that
    together are the whole split, every epoch; a third pipeline layout reads thirds."""
    DtfTinyImages(data_dir=str(tmp_path)).download_and_prepare()
    info = data.DatasetInfo("dtf_tiny_images", "image", 10, (28, 28, 1),
                            num_examples={"train": 96, "test": 32}, data_dir=str(tmp_path))
    dataset_fn = data.make_dataset_fn(info, "train", global_batch_size=12)  # 8 steps an epoch.
    for pipelines in (2, 3):
        parts = []
        for index in range(pipelines):
            context = tf.distribute.InputContext(pipelines, index, num_replicas_in_sync=pipelines * 2)
            batches = list(dataset_fn(context).take(2 * 8 * 2))  # 2 epochs x 8 steps x 2 replicas.
            seen = [int(round(float(x[0, 0, 0]) * 255)) for b, _ in batches for x in b]
            assert all(b.shape[0] == 12 // (2 * pipelines) for b, _ in batches)
            epoch_one, epoch_two = seen[:len(seen) // 2], seen[len(seen) // 2:]
            assert sorted(epoch_one) == sorted(epoch_two) and epoch_one != epoch_two  # Reshuffled.
            parts.append(set(epoch_one))
        assert set.union(*parts) == set(range(96)) and sum(map(len, parts)) == 96


def test_tfds_not_prepared_names_dataset_dir_and_command(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        data.load_info("mnist", data_dir=str(tmp_path))
    message = str(error.value)
    assert "\n" not in message
    assert f"Dataset 'mnist' is not prepared in data_dir={tmp_path}" in message
    assert f"tfds.load('mnist', data_dir='{tmp_path}')" in message


def test_unknown_dataset_and_bad_batch():
    message = r"Invalid value for `--dataset`\. Received: 'imagenet'\. Expected one of shapes, tokens, mnist"
    with pytest.raises(ValueError, match=message):
        data.load_info("imagenet")
    with pytest.raises(ValueError, match=r"Received: 10\. Expected a multiple of the 4 replicas, such as 8\."):
        data.check_global_batch_size(10, 4)
    with pytest.raises(ValueError, match=r"Received: 0\. Expected a positive integer"):
        data.check_global_batch_size(0, 1)


@pytest.fixture(scope="module")
def tokens_tfrecords(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tokens_tfrecord"))
    assert data.main(["prepare", "--dataset=tokens", f"--out={out}", "--num_shards=4"]) == 0
    return out


def test_tfrecords_read_back_the_same_examples(tokens_tfrecords):
    info = data.load_info(f"tfrecord:{tokens_tfrecords}")
    assert info.num_examples == data.load_info("tokens").num_examples
    assert len([f for f in os.listdir(tokens_tfrecords) if f.startswith("train-")]) == 4
    original = sorted(_fingerprints(data.load_source(data.load_info("tokens"), "test").batch(256), 8))
    assert sorted(_fingerprints(data.load_source(info, "test").batch(256), 8)) == original


@pytest.mark.parametrize("pipelines, replicas", [(1, 2), (2, 2), (2, 4), (4, 4)])
def test_every_layout_trains_on_the_same_global_batches(tokens_tfrecords, pipelines, replicas):
    """Replica r of any layout gets slice r of the one-process global batch, step by step."""
    info = data.load_info(f"tfrecord:{tokens_tfrecords}")
    steps = data.steps_per_epoch(info, "train", 32)
    one = data.make_dataset_fn(info, "train", global_batch_size=32, seed=3)(tf.distribute.InputContext())
    reference = [x.numpy() for x, _ in one.take(steps + 2)]  # Into the second epoch.
    dataset_fn = data.make_dataset_fn(info, "train", global_batch_size=32, seed=3)
    per_pipeline = [list(dataset_fn(tf.distribute.InputContext(pipelines, index, replicas))
                         .take((steps + 2) * replicas // pipelines).as_numpy_iterator())
                    for index in range(pipelines)]
    local = replicas // pipelines
    for step, expected in enumerate(reference):
        got = np.concatenate([per_pipeline[p][step * local + r][0]
                              for p in range(pipelines) for r in range(local)])
        np.testing.assert_array_equal(got, expected)
    assert len({_digest(row) for batch in reference[:steps] for row in batch}) == steps * 32
    assert not np.array_equal(reference[0], reference[steps])  # Each epoch its own order.


def test_resuming_at_a_step_continues_the_same_stream():
    info = data.load_info("shapes")
    dataset_fn = data.make_dataset_fn(info, "train", global_batch_size=64, seed=1)
    steps = data.steps_per_epoch(info, "train", 64)
    whole = [x for x, _ in dataset_fn(tf.distribute.InputContext()).take(steps + 5).as_numpy_iterator()]
    resumed_fn = data.make_dataset_fn(info, "train", global_batch_size=64, seed=1, start_step=steps - 3)
    resumed = [x for x, _ in resumed_fn(tf.distribute.InputContext()).take(8).as_numpy_iterator()]
    for a, b in zip(resumed, whole[steps - 3:]):
        np.testing.assert_array_equal(a, b)


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
