"""The chief's checkpoints (`ChiefCheckpoint`) in one process: what stays once pruned; the
user's callbacks across a resumed stage: plain Keras's batches, `params` and state."""

import json
import signal

import keras
import numpy as np
import pytest
from workers import faults

import distrib_tf
from distrib_tf.keras import callbacks


@pytest.fixture(autouse=True)
def _sigterm_as_it_was():
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


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


class _Recorder(keras.callbacks.Callback):
    """Records each batch's (epoch, batch) and the `params` it is given; keeps the batches
    across restarts (`get_state`/`set_state`)."""

    def __init__(self):
        super().__init__()
        self.epoch, self.batches, self.params_seen = None, [], []

    def on_train_begin(self, logs=None):
        self.params_seen.append(dict(self.params))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.params_seen.append(dict(self.params))

    def on_train_batch_begin(self, batch, logs=None):
        self.batches.append(["begin", self.epoch, batch])

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(["end", self.epoch, batch])

    def get_state(self):
        return {"batches": self.batches}

    def set_state(self, state):
        self.batches = [list(b) for b in state["batches"]]


def test_callbacks_of_a_stage_resumed_inside_an_epoch_see_plain_keras_batches_and_params(tmp_path):
    """Issue 60 item 9: 3 epochs of 10 steps, crashed at step 17, resumed from the backup of
    step 15 (a partial epoch of 5 steps, then the last epoch), then run again finished. The
    user's callback sees plain Keras's (epoch, batch) indices (epoch 2's from batch 5, not 0)
    and plain Keras's `params` (3 epochs of 10 steps, not the partial fit's 2 of 5); the
    finished fit run again restores its state (before: never restored)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype("float32")
    y = x[:, :2].argmax(axis=1)

    def fit(*callbacks):
        keras.backend.clear_session()  # The same variable names each time: the same run to resume.
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=20, epochs=3, shuffle=False, callbacks=list(callbacks), verbose=0)

    plain = _Recorder()
    fit(plain)
    assert len(plain.batches) == 60 and plain.params_seen[0] == {"verbose": 0, "epochs": 3, "steps": 10}
    crashed = _Recorder()
    with pytest.raises(RuntimeError, match="crashed"):
        with distrib_tf.Run(tmp_path / "run", backup_every_steps=5, exit_on_error=False):
            fit(crashed, faults.Crash(17))
    resumed = _Recorder()
    with distrib_tf.Run(tmp_path / "run", backup_every_steps=5, exit_on_error=False) as run:
        fit(resumed)
    assert run.summary["resumed_at_step"] == 15
    assert resumed.batches == plain.batches  # Steps 1-15 restored from the backup, 16-30 seen here.
    assert resumed.params_seen == [plain.params_seen[0]] * 3  # on_train_begin, epochs 2 and 3.
    again = _Recorder()
    with distrib_tf.Run(tmp_path / "run", backup_every_steps=5, exit_on_error=False) as run:
        fit(again)
    assert again.batches == plain.batches and again.params == plain.params
