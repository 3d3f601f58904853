"""A user's `tf.data.Dataset` under a live `distrib_tf.Run`, as keras.io writes one (a seeded
shuffle reshuffled each epoch, an augmentation map, `cache()`, `prefetch`): two runs give the
same weights bit for bit, and so does one preempted in a later epoch and restarted
(tests/workers/keras_io_data.py, one process, two replicas, float64); what the replay
reads from the dataset's graph."""

import os
import random

import keras
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
