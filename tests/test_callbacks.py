"""The chief's checkpoints (`ChiefCheckpoint`) in one process: what stays once pruned."""

import json

import keras

from distrib_tf.keras import callbacks


def test_pruning_keeps_the_newest_epochs_by_number_past_epoch_999(tmp_path):
    """Issue 53: names sorted as text put `epoch1000` before `epoch998`, so from epoch 1000 on
    the newest checkpoints were deleted and 998 and 999 kept."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    chief = callbacks.ChiefCheckpoint(str(tmp_path), "run-a", keep=2)
    chief.set_model(model)
    for epoch in (998, 999, 1000, 1001):  # 1-based, as in the names.
        chief.on_epoch_end(epoch - 1)
    chief.on_train_end()  # Written in the background until then.
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["epoch1000.json", "epoch1000.weights.h5", "epoch1001.json", "epoch1001.weights.h5"], left
    assert json.loads((tmp_path / "checkpoints" / "epoch1001.json").read_text()) == {"run": "run-a", "epoch": 1001}
