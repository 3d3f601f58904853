"""`python -m distrib_tf.data prepare`: users' own data (image folders, TFRecords) to ArrayRecord.

Real encoded JPEG and PNG files are written by each test; every mistake is one line
naming the file, exit code 2, before anything trains.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from cluster_runner import QUIET_TF
from distrib_tf import data
from distrib_tf.data import prepare
from distrib_tf.data import readers
from distrib_tf.data import records

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
CLASSES = ("cat", "dog", "eel")


def _image(seed, height, width):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _write_folder(root, per_class=12):
    """A folder of real images, one subfolder per class: JPEGs of several sizes and one PNG each."""
    for c, name in enumerate(CLASSES):
        os.makedirs(root / name)
        for i in range(per_class):
            pixels = _image(100 * c + i, 20 + i, 30 - i)
            encoded = tf.io.encode_png(pixels) if i == 0 else tf.io.encode_jpeg(pixels, quality=90)
            (root / name / f"{i:03d}.{'png' if i == 0 else 'jpg'}").write_bytes(encoded.numpy())
        (root / name / "notes.txt").write_text("not an image, skipped")


def _prepare(*args):
    return subprocess.run([sys.executable, "-m", "distrib_tf.data", "prepare", *args],
                          capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)


def _one_error_line(result):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("distrib_tf.data: error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def test_an_image_folder_is_decoded_and_resized_in_the_pipeline(tmp_path):
    _write_folder(tmp_path / "photos")
    info = prepare.prepare(f"images:{tmp_path / 'photos'}", str(tmp_path / "out"), num_shards=3,
                           image_size=(16, 24), test_fraction=0.25)
    meta = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert meta["classes"] == list(CLASSES) and meta["encoding"] == "image"
    assert info.input_shape == (16, 24, 3) and info.num_classes == 3
    assert sum(info.num_examples.values()) == 3 * 12 and min(info.num_examples.values()) > 0
    # Example k of the pipeline is the k-th file of its split, decoded and resized exactly so.
    files = {split: [] for split in ("train", "test")}
    for split in files:
        for record in records.RecordReader(records.split_shards(
                info.data_dir, meta, split))(np.arange(info.num_examples[split])):
            example = tf.io.parse_single_example(record, readers.IMAGE_FEATURES)
            files[split].append((example["image/encoded"].numpy(), int(example["image/class/label"])))
    x, y = readers.make_reader(info, "train")(tf.range(info.num_examples["train"], dtype=tf.int64))
    for k, (encoded, label) in enumerate(files["train"]):
        np.testing.assert_array_equal(x[k].numpy(), readers.decode_image(encoded, [16, 24, 3]).numpy())
        assert int(y[k]) == label
    originals = {tf.io.decode_image(e).numpy().tobytes() for e, _ in files["train"] + files["test"]}
    on_disk = {tf.io.decode_image((tmp_path / "photos" / c / f).read_bytes()).numpy().tobytes()
               for c in CLASSES for f in os.listdir(tmp_path / "photos" / c) if not f.endswith(".txt")}
    assert originals == on_disk  # Every image once, stored as it was.


def test_the_main_job_trains_on_a_prepared_image_folder(tmp_path):
    _write_folder(tmp_path / "photos", per_class=24)
    result = _prepare(f"--dataset=images:{tmp_path / 'photos'}", f"--out={tmp_path / 'out'}", "--image_size=28,28",
                      "--test_fraction=0.3")
    assert result.returncode == 0, result.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "distrib_tf.train", f"--dataset=array_record:{tmp_path / 'out'}",
                          "--epochs=1", "--global_batch_size=8", f"--model_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dataset"]["input_shape"] == [28, 28, 3] and summary["dataset"]["num_classes"] == 3
    assert summary["epochs"][0]["loss"] > 0


def test_tfrecords_with_the_common_image_features_convert_in_one_command(tmp_path):
    source = tmp_path / "tfrecords"
    source.mkdir()
    written = {}
    for name, labels in (("train-00000-of-00002", [1, 2, 3]), ("train-00001-of-00002", [4, 5]),
                         ("validation-00000-of-00001", [1, 5])):
        with tf.io.TFRecordWriter(str(source / name)) as writer:
            for i, label in enumerate(labels):
                encoded = tf.io.encode_jpeg(_image(label * 10 + i, 12, 12)).numpy()
                writer.write(prepare.image_record(encoded, label))
                written.setdefault(name[:5], []).append((encoded, label))
    result = _prepare(f"--dataset=tfrecord:{source}", f"--out={tmp_path / 'out'}", "--image_size=12,12")
    assert result.returncode == 0, result.stderr[-2000:]
    info = data.load_info(f"array_record:{tmp_path / 'out'}")
    assert info.num_examples == {"train": 5, "test": 2} and info.num_classes == 6  # Labels kept as they are.
    x, y = readers.make_reader(info, "train")(tf.range(5, dtype=tf.int64))
    assert y.numpy().tolist() == [label for _, label in written["train"]]
    np.testing.assert_array_equal(x[3].numpy(), readers.decode_image(written["train"][3][0], [12, 12, 3]).numpy())


def test_training_on_tfrecords_names_the_conversion(tmp_path):
    run = subprocess.run([sys.executable, "-m", "distrib_tf.train", f"--dataset=tfrecord:{tmp_path}",
                          f"--model_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=ENV,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert (f"`python -m distrib_tf.data prepare --dataset=tfrecord:{tmp_path} --out=DIR` converts it once"
            in run.stderr)
    assert not (tmp_path / "run").exists()


def _damage(kind, out):
    meta_path = out / "dataset.json"
    meta = json.loads(meta_path.read_text())
    shard = out / meta["files"]["train"][1]["path"]
    if kind == "missing shard":
        shard.unlink()
    elif kind == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif kind == "counts disagree":
        meta["files"]["train"][1]["num_records"] += 1
        meta["num_examples"]["train"] += 1
        meta_path.write_text(json.dumps(meta))
    elif kind == "num_examples disagree":
        meta["num_examples"]["train"] = 5
        meta_path.write_text(json.dumps(meta))
    elif kind == "num_examples a list":  # Before: AttributeError past the CLI, a traceback.
        meta["num_examples"] = []
        meta_path.write_text(json.dumps(meta))
    return str(shard), str(meta_path)


@pytest.mark.parametrize("kind, error", [
    ("missing shard", "Missing shard {shard}, listed in {meta}."),
    ("truncated shard", "Cannot read shard {shard} ("),
    ("counts disagree", "Shard {shard} holds 1024 records; {meta} says 1025."),
    ("num_examples disagree", "Invalid value for `num_examples.train` in {meta}. Received: 5. Expected 8192"),
    ("num_examples a list", "Invalid value for `num_examples` in {meta}. Received: []. Expected an object"),
])
def test_damaged_shards_stop_the_job_before_it_trains(tmp_path, kind, error):
    out = tmp_path / "shapes"
    prepare.prepare("shapes", str(out), num_shards=8)
    shard, meta = _damage(kind, out)
    run = subprocess.run([sys.executable, "-m", "distrib_tf.train", f"--dataset=array_record:{out}",
                          f"--model_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=ENV,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("distrib-tf-train: error: ")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert error.format(shard=shard, meta=meta) in lines[0]
    assert not (tmp_path / "run").exists()


def test_an_unreadable_image_is_named(tmp_path):
    _write_folder(tmp_path / "photos")
    broken = tmp_path / "photos" / "dog" / "001.jpg"
    broken.write_bytes(broken.read_bytes()[:20])
    line = _one_error_line(_prepare(f"--dataset=images:{tmp_path / 'photos'}", f"--out={tmp_path / 'out'}",
                                    "--test_fraction=0.3"))
    assert f"Cannot decode image {broken} (20 bytes)" in line
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_a_record_that_does_not_parse_is_named(tmp_path):
    source = tmp_path / "tfrecords"
    source.mkdir()
    for name in ("train-0", "test-0"):
        with tf.io.TFRecordWriter(str(source / name)) as writer:
            writer.write(prepare.image_record(tf.io.encode_jpeg(_image(0, 8, 8)).numpy(), 1))
            writer.write(b"not a tf.train.Example")
    line = _one_error_line(_prepare(f"--dataset=tfrecord:{source}", f"--out={tmp_path / 'out'}"))
    assert f"Record 1 of {source / 'test-0'} does not parse" in line or f"Record 1 of {source / 'train-0'}" in line


def test_a_record_changed_after_prepare_is_named_at_read_time(tmp_path):
    out = tmp_path / "tokens"
    info = prepare.prepare("tokens", str(out), num_shards=2)
    meta = json.loads((out / "dataset.json").read_text())
    first = out / meta["files"]["test"][0]["path"]
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel

    writer = array_record_module.ArrayRecordWriter(str(first), "group_size:1")
    for _ in range(meta["files"]["test"][0]["num_records"]):
        writer.write(b"short")
    writer.close()
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        next(iter(tf.data.Dataset.from_tensors(tf.constant([0], tf.int64)).map(readers.make_reader(info, "test"))))
    expected = f"Record 0 of {first} has 5 bytes. Expected 264: the shard changed after prepare."
    assert records.data_error_in(error.value) == expected
    run = subprocess.run([sys.executable, "-m", "distrib_tf.train", "--model=transformer", f"--dataset={info.name}",
                          "--epochs=1", "--steps_per_epoch=2", f"--model_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
    assert run.returncode == 2 and f"distrib-tf-train: error: chief:0: {expected}" in run.stderr, run.stderr[-2000:]


EXITS_MID_PIPELINE = """
import sys
import tensorflow as tf
from distrib_tf import data
info = data.load_info(sys.argv[1])
iterator = iter(data.make_dataset_fn(info, "train", global_batch_size=64)(tf.distribute.InputContext()))
for _ in range(3):
    next(iterator)
print("done", flush=True)
"""


@pytest.mark.slow  # 19 s: make soak (make test's time).
def test_a_script_may_exit_while_its_pipeline_prefetches(tmp_path):
    """Without `records.ExitGuard` this aborted ('terminate called without an active exception')
    or hung in every run tried: tf.data's threads calling into Python during its finalization."""
    info = prepare.prepare("tokens", str(tmp_path / "tokens"), num_shards=2)
    for _ in range(3):  # Without the guard 2 runs of 3 aborted here.
        run = subprocess.run([sys.executable, "-c", EXITS_MID_PIPELINE, info.name], capture_output=True, text=True,
                             env=ENV, timeout=120, cwd=ROOT)
        assert run.returncode == 0 and run.stdout == "done\n", (run.returncode, run.stderr[-2000:])


def _files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_prepare_into_its_own_source_and_a_failed_prepare_leaves_out_as_it_was(tmp_path):
    """Before: `--dataset=array_record:D --out=D` deleted D/dataset.json first, then failed with
    "No dataset.json in D", and D no longer loaded; a failed prepare left shards replaced."""
    out = tmp_path / "d"
    prepare.prepare("shapes", str(out), num_shards=4)
    ids = tf.range(0, 8192, 97, dtype=tf.int64)
    before = readers.make_reader(data.load_info(f"array_record:{out}"), "train")(ids)
    result = _prepare(f"--dataset=array_record:{out}", f"--out={out}", "--num_shards=2")
    assert result.returncode == 0, result.stderr[-2000:]
    info = data.load_info(f"array_record:{out}")
    assert len(records.read_meta(str(out))["files"]["train"]) == 2
    after = readers.make_reader(info, "train")(ids)
    np.testing.assert_array_equal(before[0].numpy(), after[0].numpy())
    np.testing.assert_array_equal(before[1].numpy(), after[1].numpy())
    kept = _files(out)
    for split in ("train", "test"):  # The train split is written before the test split fails.
        (tmp_path / "broken" / split / "cat").mkdir(parents=True)
    (tmp_path / "broken" / "train" / "cat" / "0.png").write_bytes(tf.io.encode_png(_image(0, 8, 8)).numpy())
    (tmp_path / "broken" / "test" / "cat" / "0.png").write_bytes(b"not a png")
    line = _one_error_line(_prepare(f"--dataset=images:{tmp_path / 'broken'}", f"--out={out}"))
    assert "test/cat/0.png" in line, line
    assert _files(out) == kept  # As it was: nothing replaced, nothing half-written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "d"]  # No staging left behind.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    refused = _prepare("--dataset=shapes", f"--out={tmp_path / 'mine'}")
    assert "holds files but no dataset.json" in _one_error_line(refused)


def test_a_dataset_prepared_again_is_never_missing_and_reaches_the_disk(tmp_path, monkeypatch):
    """Issue 42 item 9: the earlier dataset was renamed away before the new one came, a moment
    with no `--out` for a job reading it; and nothing was synced before the renames."""
    out = tmp_path / "d"
    _write_folder(tmp_path / "photos", per_class=3)
    prepare.prepare(f"images:{tmp_path / 'photos'}", str(out), num_shards=2, image_size=(8, 8), test_fraction=0.3)
    gaps, synced, rename = [], [], os.rename

    def watched(src, dst):
        rename(src, dst)
        if not out.exists():
            gaps.append((src, dst))

    monkeypatch.setattr(prepare.os, "rename", watched)
    monkeypatch.setattr(prepare.backup, "fsync", lambda path: synced.append(os.path.relpath(path, tmp_path)))
    prepare.prepare(f"images:{tmp_path / 'photos'}", str(out), num_shards=3, image_size=(8, 8), test_fraction=0.3)
    assert gaps == [] and len(records.read_meta(str(out))["files"]["train"]) == 3
    assert "." in synced and any(path.endswith(records.META) for path in synced), synced  # Files, then the parent.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "photos"]  # The earlier one deleted.


def test_an_older_dataset_json_without_a_field_is_one_line(tmp_path):
    """Before: a KeyError traceback from `prepare --dataset=tfrecord:D` of an older directory."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "dataset.json").write_text(json.dumps({"format": "tfrecord", "kind": "image"}))
    with tf.io.TFRecordWriter(str(tmp_path / "old" / "train-00000.tfrecord")) as writer:
        writer.write(b"")
    with tf.io.TFRecordWriter(str(tmp_path / "old" / "test-00000.tfrecord")) as writer:
        writer.write(b"")
    line = _one_error_line(_prepare(f"--dataset=tfrecord:{tmp_path / 'old'}", f"--out={tmp_path / 'new'}"))
    assert "Invalid value for `input_shape` in" in line and "Received: None" in line, line
    assert not (tmp_path / "new").exists()
