"""Backups survive a process killed while writing them."""

import json

import keras
import numpy as np
import pytest

from distrib_tf.callbacks import BackupAndRestore


class KilledWhileWriting(Exception):
    pass


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _interrupted_second_backup(callback_class, backup_dir):
    """Backs up epoch 1, then dies halfway through writing epoch 2's weights."""
    model = _model()
    first = [w.copy() for w in model.get_weights()]
    callback = callback_class(str(backup_dir))
    callback.set_model(model)
    callback.on_epoch_end(0)
    save_weights = model.save_weights

    def half_write(filepath, overwrite=True):
        with open(filepath, "wb") as f:
            f.write(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)  # A torn file, as left by SIGKILL.
        raise KilledWhileWriting()

    model.save_weights = half_write
    model.set_weights([w + 1 for w in first])
    with pytest.raises(KilledWhileWriting):
        callback.on_epoch_end(1)
    model.save_weights = save_weights
    return first


def test_backup_killed_while_writing_restores_the_last_good_one(tmp_path):
    first = _interrupted_second_backup(BackupAndRestore, tmp_path)
    restored = _model()
    callback = BackupAndRestore(str(tmp_path))
    callback.set_model(restored)
    callback.on_train_begin()
    for a, b in zip(restored.get_weights(), first):
        np.testing.assert_array_equal(a, b)
    assert restored._initial_epoch == 1  # pylint: disable=protected-access
    assert json.loads((tmp_path / "training_metadata.json").read_text())["epoch"] == 1


def test_keras_backup_killed_while_writing_is_lost(tmp_path):
    """Why the atomic version exists: Keras's own writes in place."""
    _interrupted_second_backup(keras.callbacks.BackupAndRestore, tmp_path)
    callback = keras.callbacks.BackupAndRestore(str(tmp_path))
    callback.set_model(_model())
    with pytest.raises(OSError):
        callback.on_train_begin()
