"""The side-car evaluator against what a real `model_dir` holds: an earlier run's
checkpoints, a run that ended before its last epoch, a chief whose files never come."""

import json
import os
import time

import numpy as np
import pytest

from distrib_tf.keras import backup
from distrib_tf.keras import callbacks
from distrib_tf.train import evaluator


def _model_and_data():
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 3), "float32")
    return model, tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)


def _checkpoint(model, model_dir, epoch, run):
    """What the chief writes at an epoch's end (`ChiefCheckpoint`)."""
    chief = callbacks.ChiefCheckpoint(str(model_dir), run)
    chief.set_model(model)
    chief.on_epoch_end(epoch - 1)
    chief.on_train_end()  # Written in the background until then.


def test_an_earlier_runs_checkpoints_are_not_evaluated_and_a_silent_chief_times_out(tmp_path):
    model, data = _model_and_data()
    for epoch in (1, 2):
        _checkpoint(model, tmp_path, epoch, run="earlier")
    started = time.monotonic()
    with pytest.raises(evaluator.EvaluatorTimeout, match=r"no new checkpoint of this run .* for 2 s"):
        evaluator.evaluate_checkpoints(model, data, steps=2, model_dir=str(tmp_path), last_epoch=2,
                                       run="this", poll_seconds=0.1, idle_seconds=2)
    assert time.monotonic() - started < 30
    assert not os.path.exists(tmp_path / "eval" / "eval.json")  # Nothing of the earlier run evaluated.


def test_a_run_that_ended_before_its_last_epoch_ends_the_evaluator(tmp_path):
    model, data = _model_and_data()
    _checkpoint(model, tmp_path, 1, run="this")
    backup.write_json_atomically(os.path.join(tmp_path, "summary.json"), {"run_id": "this"})  # Stopped after epoch 1.
    results = evaluator.evaluate_checkpoints(model, data, steps=2, model_dir=str(tmp_path), last_epoch=3,
                                             run="this", poll_seconds=0.1, idle_seconds=600)
    assert [r["epoch"] for r in results] == [1]
    with open(tmp_path / "eval" / "eval.json") as f:
        assert json.load(f)["run"] == "this"


def test_the_patience_grows_with_the_longest_wait_seen(tmp_path):
    """Issue 33 item 4: a fixed 3600 s ended an evaluator whose epochs take over an hour. With
    `idle_seconds=2`, a first checkpoint after 1.2 s and the next ones 2.5 s apart, it waits
    for each (3 times the longest gap seen); with a fixed patience it gave up at the second."""
    import threading  # pylint: disable=import-outside-toplevel

    model, data = _model_and_data()

    def chief():
        for epoch, wait in ((1, 1.2), (2, 2.5), (3, 2.5)):
            time.sleep(wait)
            _checkpoint(model, tmp_path, epoch, run="this")

    writer = threading.Thread(target=chief)
    writer.start()
    try:
        results = evaluator.evaluate_checkpoints(model, data, steps=2, model_dir=str(tmp_path), last_epoch=3,
                                                 run="this", poll_seconds=0.05, idle_seconds=2)
    finally:
        writer.join()
    assert [r["epoch"] for r in results] == [1, 2, 3]
