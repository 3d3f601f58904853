"""A user's `tf.data.Dataset` under a live `distrib_tf.Run`, as keras.io writes one (a seeded
shuffle reshuffled each epoch, an augmentation map, `cache()`, `prefetch`): two runs give the
same weights bit for bit, and so does one preempted in a later epoch and restarted
(tests/workers/keras_io_data.py, one process, two replicas, float64), and on 2 workers read
from an image folder by `image_dataset_from_directory`; what the replay reads from the
dataset's graph."""

import json
import os
import random
import re
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from cluster_runner import QUIET_TF
from cluster_runner import run_script
from distrib_tf.data import replay

ROOT = os.path.dirname(os.path.dirname(__file__))
SCRIPT = os.path.join(ROOT, "tests", "workers", "keras_io_data.py")
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
STEPS = 16  # An epoch's, in the script.


def _script(model_dir, *args):
    return run_script(SCRIPT, model_dir, *args, env=ENV)


def test_a_keras_io_pipeline_runs_twice_alike_and_resumes_bit_identical(tmp_path):
    """Issue 51: a batch read to learn the batch size drew a reshuffle seed and half-filled
    the cache (two outcomes in three runs); a resume made a new iterator for the epochs after
    the resumed one, which drew other reshuffle seeds (every epoch after it differed)."""
    code, text, first = _script(tmp_path / "a")
    assert code == 0, text[-3000:]
    code, text, second = _script(tmp_path / "b")
    assert code == 0, text[-3000:]
    assert second == first
    step = random.Random().randrange(STEPS + 1, 3 * STEPS)  # Inside epoch 2 or 3.
    step += step % STEPS == 0
    code, text, _ = _script(tmp_path / "c", f"--sigterm_at_step={step}")
    assert code == 75, text[-3000:]
    code, text, resumed = _script(tmp_path / "c")
    assert code == 0, text[-3000:]
    assert f"chief:0 resumes at step {step}" in text and f"replays a tf.data.Dataset to step {step}" in text, (
        text[-3000:])
    assert "draws in an order its threads decide" not in text
    assert resumed == first, (step, resumed, first)


def _two_workers(model_dir, *args):
    """The script on 2 workers through the launcher, on images: `(exit code, output, {task: result})`."""
    result = subprocess.run([sys.executable, "-m", "distrib_tf.launch", "--workers=2", "--", sys.executable,
                             SCRIPT, str(model_dir), "--cpu_replicas=1", "--images", *args],
                            capture_output=True, text=True, timeout=300, env=ENV)
    text = result.stdout + result.stderr
    return result.returncode, text, {task: json.loads(found) for task, found in
                                     re.findall(r"\[(worker:\d)\] RESULT (\{.*\})", text)}


@pytest.mark.slow  # 65 s: make soak. make test replays keras.io's pipeline, trains an image folder (test_prepare).
def test_an_image_folder_pipeline_on_two_workers_runs_twice_alike_and_resumes_bit_identical(tmp_path):
    """The same rows as an image folder read by `keras.utils.image_dataset_from_directory` with a
    seed (which reshuffles its files each epoch), then keras.io's map, cache and prefetch, on 2
    workers (each reads its shard, Keras's auto-sharding), as the separate processes wrote it:
    two runs alike on both workers, and a run preempted at a random step of a later epoch ends
    on their weights and History."""
    code, text, first = _two_workers(tmp_path / "a")
    assert code == 0 and len(first) == 2, text[-3000:]
    assert first["worker:0"] == first["worker:1"], first
    code, text, second = _two_workers(tmp_path / "b")
    assert code == 0 and second == first, text[-3000:]
    step = random.Random().randrange(STEPS + 1, 3 * STEPS)
    step += step % STEPS == 0
    code, text, _ = _two_workers(tmp_path / "c", f"--sigterm_at_step={step}")
    assert code == 75, text[-3000:]
    saved = {int(s) for s in re.findall(r"preempted: backed up step (\d+) like every worker", text)}
    code, text, resumed = _two_workers(tmp_path / "c")
    assert code == 0, text[-3000:]
    assert len(saved) == 1 and len(re.findall(rf"worker:\d resumes at step {saved.pop()} ", text)) == 2, text[-3000:]
    assert resumed == first, (step, resumed, first)


def test_the_replay_reads_the_batch_size_and_names_draws_threads_order():
    data = tf.data.Dataset.range(10).shuffle(10, seed=1).batch(4).map(lambda b: b * 2).prefetch(2).cache()
    assert replay.batch_size(data) == 4
    assert replay.batch_size(tf.data.Dataset.range(10).batch(4).unbatch().batch(3)) == 3
    assert replay.batch_size(tf.data.Dataset.range(10).batch(4).unbatch()) is None
    images = tf.data.Dataset.from_tensor_slices(tf.zeros([8, 4, 4, 1])).batch(4)
    flip = keras.layers.RandomFlip("horizontal", seed=1)
    assert replay.unreplayable(images.map(lambda t: t + tf.random.uniform([]), num_parallel_calls=2)) == [
        "RandomUniform in ParallelMapDatasetV2"]
    assert replay.unreplayable(images.map(flip, num_parallel_calls=2)) == ["AssignVariableOp in ParallelMapDatasetV2"]
    assert replay.unreplayable(images.map(lambda t: t + tf.random.uniform([]))) == []  # In order: it replays.
    stateless = images.map(lambda t: t + tf.random.stateless_uniform([], seed=[1, 2]), num_parallel_calls=2)
    assert replay.unreplayable(stateless) == []
