"""The callbacks of the main job: backup, checkpoints, TensorBoard, timing, progress.

Under several workers only the chief writes into `model_dir`: Keras's own
`BackupAndRestore`, `ModelCheckpoint` and `TensorBoard` are made chief-aware by
`distrib_tf._keras_compat`, so a user's own callbacks get the same behaviour.
"""

import json
import os
import time

import keras


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's `BackupAndRestore`, writing every backup atomically.

    Weights and metadata go to temporary files that then replace the previous backup,
    so a process killed while writing leaves the last good backup whole (Keras writes
    in place). Only the chief writes, as `distrib_tf._keras_compat` makes Keras's own do.
    """

    def _save_model(self):
        if not self.model.distribute_strategy.extended.should_checkpoint:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        weights = os.path.join(self.backup_dir, "writing.weights.h5")
        metadata = self._training_metadata_path + ".writing"
        self.model.save_weights(weights, overwrite=True)
        with open(metadata, "w", encoding="utf-8") as f:
            json.dump({"epoch": self._current_epoch, "batch": self._last_batch_seen}, f)
        os.replace(weights, self._weights_path)
        os.replace(metadata, self._training_metadata_path)


class EpochTimer(keras.callbacks.Callback):
    """Records the training seconds and examples per second of every epoch into the logs.

    An epoch's time runs from its start to its last training step: validation and
    epoch-end callbacks (checkpoints) are left out, so the rate is the training step's.
    """

    def __init__(self, examples_per_epoch: int):
        super().__init__()
        self.examples_per_epoch = examples_per_epoch
        self.seconds: list[float] = []
        self.first_step_at: float | None = None  # Unix time the first step ended.
        self._start = self._last_step = 0.0

    def on_train_batch_end(self, batch, logs=None):
        self._last_step = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._last_step = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = self._last_step - self._start
        self.seconds.append(seconds)
        if logs is not None:
            logs["epoch_seconds"] = seconds
            logs["examples_per_second"] = self.examples_per_epoch / seconds


class EpochLine(keras.callbacks.Callback):
    """Prints one line per epoch: for workers that show no progress bar."""

    def __init__(self, task: str, epochs: int):
        super().__init__()
        self.task, self.epochs = task, epochs

    def on_epoch_end(self, epoch, logs=None):
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted((logs or {}).items()))
        print(f"{self.task} epoch {epoch + 1}/{self.epochs} {metrics}", flush=True)


def make_callbacks(model_dir: str, *, task: str, is_chief: bool, epochs: int,
                   examples_per_epoch: int) -> list[keras.callbacks.Callback]:
    """The main job's callbacks, writing under `model_dir` (the chief only)."""
    callbacks = [
        EpochTimer(examples_per_epoch),
        BackupAndRestore(os.path.join(model_dir, "backup")),
        keras.callbacks.ModelCheckpoint(
            os.path.join(model_dir, "checkpoints", "epoch{epoch:03d}.weights.h5"),
            save_weights_only=True,
        ),
        keras.callbacks.TensorBoard(os.path.join(model_dir, "logs"), write_graph=False),
    ]
    if not is_chief:
        callbacks.append(EpochLine(task, epochs))
    return callbacks
