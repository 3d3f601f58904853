"""A Keras user's own script on the run API, with a SIGTERM in the end of its second epoch.

    TF_CONFIG=... python tests/workers/epoch_end.py CASE --model_dir=DIR [--sigterm_task=TASK]

CASE, where one worker sends itself SIGTERM in epoch 2 of 3, as a scheduler would:

- `validation`: worker:1, in a validation batch;
- `validation_end`: worker:1, in validation's `on_test_end`, 1 s after its last collective,
  when the chief is already in its `on_epoch_end` callbacks (whose collectives then fail);
- `last_step`: the chief, after the epoch's last training step;
- `on_epoch_end`: the chief, in its own `on_epoch_end` callback, after a stateful callback
  counted the epoch and before `ModelCheckpoint` wrote its file;
- `none`: no SIGTERM (the uninterrupted run, or the restart of a preempted one).

The callbacks are keras.io's: `ModelCheckpoint` writes `shared/save_at_{epoch}.weights.h5`,
`EarlyStopping` counts its epochs without improvement; a stateful `EpochCount` counts the
epoch ends it saw. Each worker prints `TASK SIGTERM in CASE` when it sends one, and at the end
`RESULT {...}`: its History, those callbacks' states and a digest of its weights.
"""

import argparse
import hashlib
import json
import os
import signal
import time

import keras
import numpy as np

import distrib_tf

STEPS, EPOCHS, BATCH = 4, 3, 16


class EpochCount(keras.callbacks.Callback):
    """Counts the epoch ends it saw; its state survives a restart (`get_state`/`set_state`)."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(epoch + 1)

    def get_state(self):
        return {"ends": self.ends}

    def set_state(self, state):
        self.ends = list(state["ends"])


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM at `case` in epoch 2 if `send`."""

    def __init__(self, case, task, *, send):
        super().__init__()
        self.case, self.task, self.send, self.epoch = case, task, send, 0

    def _sigterm(self):
        print(f"{self.task} SIGTERM in {self.case}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if self.send and self.case == "last_step" and int(self.model.optimizer.iterations.numpy()) == 2 * STEPS:
            self._sigterm()

    def on_test_batch_end(self, batch, logs=None):
        if self.send and self.case == "validation" and self.epoch == 2:
            self.send = False
            self._sigterm()

    def on_test_end(self, logs=None):
        if self.send and self.case == "validation_end" and self.epoch == 2:
            time.sleep(1)
            self._sigterm()

    def on_epoch_end(self, epoch, logs=None):
        if self.send and self.case == "on_epoch_end" and epoch + 1 == 2:
            self._sigterm()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["validation", "validation_end", "last_step", "on_epoch_end", "none"])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--sigterm_task", help="who sends it (default: worker:1 in validation, else worker:0)")
    args = parser.parse_args()
    with distrib_tf.Run(args.model_dir, seed=0) as run:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
        y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
        xv = rng.normal(size=(2 * BATCH, 4)).astype("float32")
        yv = xv.sum(axis=1, keepdims=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
        shared = os.path.join(args.model_dir, "shared")
        os.makedirs(shared, exist_ok=True)
        sender = args.sigterm_task or ("worker:1" if args.case.startswith("validation") else "worker:0")
        count, stopping = EpochCount(), keras.callbacks.EarlyStopping(monitor="val_loss", patience=10)
        callbacks = [
            count,
            SigtermAt(args.case, run.task, send=run.task == sender),
            keras.callbacks.ModelCheckpoint(os.path.join(shared, "save_at_{epoch}.weights.h5"),
                                            save_weights_only=True),
            stopping,
        ]
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_data=(xv, yv),
                            callbacks=callbacks, verbose=0)
        weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()
        print("RESULT " + json.dumps({
            "task": run.task, "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "epoch_ends": count.ends, "early_stopping": [stopping.wait, float(stopping.best), stopping.best_epoch],
            "weights": weights}), flush=True)


if __name__ == "__main__":
    main()
