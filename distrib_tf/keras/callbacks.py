"""The callbacks of the main job: checkpoints, TensorBoard, timing, progress.

Every worker backs up its own state (`distrib_tf.keras.worker_backup.WorkerBackup`); only the chief
writes what a user reads (`checkpoints/`, `logs/`). Keras's own `ModelCheckpoint`,
`BackupAndRestore` and `TensorBoard` are made chief-aware by `distrib_tf.keras.compat`,
so a user's own callbacks get the same behaviour.
"""

import glob
import io
import json
import logging
import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from distrib_tf.keras import backup
from distrib_tf.keras import steps as steps_lib
from distrib_tf.keras import user_view

logger = logging.getLogger("distrib_tf")


def checkpoint_path(model_dir: str, epoch: int, *, stage: int = 0) -> str:
    """Where the chief writes the checkpoint of `epoch` (1-based) of a run's `stage` (0-based:
    its `fit` call): `epoch003.weights.h5` for the first, `fit2-epoch003.weights.h5` for the
    second, so that no stage overwrites another's."""
    prefix = f"fit{stage + 1}-" if stage else ""
    return os.path.join(model_dir, "checkpoints", f"{prefix}epoch{epoch:03d}.weights.h5")


class ChiefCheckpoint(keras.callbacks.Callback):
    """The chief writes `checkpoints/epochNNN.weights.h5` at every epoch end, atomically
    (`fitK-epochNNN.weights.h5` in a run's `K`th `fit` call: `stage=K - 1`).

    The weights (Keras's `.weights.h5`, for `model.load_weights` and the side-car
    evaluator) are made in memory, then written in the background (`backup.WRITER`) to a
    temporary file that is renamed, so an evaluator never reads a checkpoint half-written;
    then `epochNNN.json` names the run (`run`) and the epoch, so that it never takes an
    earlier run's checkpoint in the same directory for this one's. Other workers write
    nothing (Keras 3 saving runs no collectives). `keep`: this run's last `keep` checkpoints
    stay, by epoch number, older ones go (`None`: all stay).
    """

    def __init__(self, model_dir: str, run: str = "", *, keep: int | None = None, stage: int = 0):
        super().__init__()
        self.model_dir, self.run, self.keep, self.stage = model_dir, run, keep, stage

    def on_epoch_end(self, epoch, logs=None):
        if not self.model.distribute_strategy.extended.should_checkpoint:
            return
        path, image = checkpoint_path(self.model_dir, epoch + 1, stage=self.stage), weights_image(self.model)
        backup.WRITER.submit(lambda: self._write(path, epoch + 1, image))

    def on_train_end(self, logs=None):
        backup.WRITER.wait()

    def _write(self, path: str, epoch: int, image) -> None:
        backup.make_private_dirs(os.path.dirname(path))
        writing = path[: -len(".weights.h5")] + ".writing.weights.h5"
        with open(writing, "wb") as f:
            f.write(image)
            f.flush()
            os.fsync(f.fileno())
        os.replace(writing, path)
        backup.fsync(os.path.dirname(path))
        backup.write_json_atomically(checkpoint_run_path(path), {"run": self.run, "epoch": epoch})
        if self.keep:
            self._prune()

    def _prune(self) -> None:
        """Deletes this run's checkpoints but the last `keep` by epoch (not by name: `epoch1000`
        sorts before `epoch999` as text); another run's, or another stage's, are not ours."""
        ours = []
        for named in glob.glob(os.path.join(glob.escape(self.model_dir), "checkpoints", "*epoch*.json")):
            try:
                with open(named, encoding="utf-8") as f:
                    described = json.load(f)
            except (OSError, ValueError):
                continue
            if described.get("run") == self.run and isinstance(described.get("epoch"), int):
                ours.append((described["epoch"], named))
        for _, named in sorted(ours)[: -self.keep]:
            for each in (named[: -len(".json")] + ".weights.h5", named):
                try:
                    os.remove(each)
                except FileNotFoundError:
                    pass


def weights_image(model) -> memoryview:
    """The bytes `model.save_weights` writes (Keras's `.weights.h5`), made in memory."""
    buffer = io.BytesIO()
    try:
        from keras.src.saving import saving_lib  # pylint: disable=import-outside-toplevel
        store = saving_lib.H5IOStore(buffer, mode="w")
        saving_lib._save_state(model, weights_store=store, assets_store=None,  # pylint: disable=protected-access
                               inner_path="", visited_saveables=set())
        store.close()
    except (ImportError, AttributeError, TypeError):  # A Keras without them: through a file.
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "image.weights.h5")
            model.save_weights(path)
            with open(path, "rb") as f:
                buffer = io.BytesIO(f.read())
    return buffer.getbuffer()


def checkpoint_run_path(path: str) -> str:
    """The file beside checkpoint `path` that names its run."""
    return path[: -len(".weights.h5")] + ".json"


class EpochTimer(keras.callbacks.Callback):
    """Records the training seconds and examples per second of every epoch into the logs.

    An epoch's time runs from its start to its last training step: validation and
    epoch-end callbacks (checkpoints) are left out, so the rate is the training step's. An
    epoch's examples are those of the steps it ran (`examples_per_step` each): an epoch
    resumed after its start counts only its remaining steps.
    """

    def __init__(self, examples_per_step: int):
        super().__init__()
        self.examples_per_step = examples_per_step
        self.seconds: list[float] = []
        self.examples: list[int] = []  # Each epoch's, as trained here.
        self._steps = 0
        self.first_step_at: float | None = None  # Unix time the first step ended.
        self.ended_at: list[float] = []  # Unix time each epoch ended, validation included.
        self._start = self._last_step = 0.0

    def on_train_batch_end(self, batch, logs=None):
        self._last_step = time.perf_counter()
        self._steps += 1
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._last_step = time.perf_counter()
        self._steps = 0

    def on_epoch_end(self, epoch, logs=None):
        seconds = self._last_step - self._start
        self.seconds.append(seconds)
        self.examples.append(self._steps * self.examples_per_step)
        self.ended_at.append(time.time())
        if logs is not None:
            logs["epoch_seconds"] = seconds
            logs["examples_per_second"] = self.examples[-1] / seconds

    def steady_rate(self) -> float | None:
        """Examples per second, leaving out the first epoch (tracing) when there are others."""
        first = 1 if len(self.seconds) > 1 else 0
        seconds = sum(self.seconds[first:])
        return sum(self.examples[first:]) / seconds if seconds else None


class ProfileSteps(keras.callbacks.Callback):
    """A TensorBoard profile of the run's steps `first` to `last` (1-based) on this worker.

    Every worker profiles its own steps into `log_dir` (`model_dir/logs/<task>/plugins/
    profile/`, on its own disk): TensorBoard's Profile tab shows one run per worker.

    Several workers: on TensorFlow 2.21, stopping the profile can crash a worker (a SIGSEGV
    in the host tracer's `SplitEventTracker::FindStartAndMerge`; how often: BENCHMARKS.md,
    "Known crashes"), so each such profile gets a warning. One process profiles reliably.
    """

    def __init__(self, log_dir: str, first: int, last: int, workers: int = 1):
        super().__init__()
        self.log_dir, self.first, self.last = log_dir, first, last
        self._step, self._active = 0, False
        if workers > 1:
            logger.warning("--profile_steps with %d workers: TensorFlow's host tracer can crash "
                           "a worker when the profile stops (a SIGSEGV); profile one process "
                           "where you can.", workers)

    def on_train_begin(self, logs=None):
        self._step = steps_lib.iterations(self.model.optimizer)

    def on_train_batch_begin(self, batch, logs=None):
        if self._step + 1 == self.first and not self._active:
            tf.profiler.experimental.start(self.log_dir)
            self._active = True

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._active and self._step >= self.last:
            self._stop()

    def on_train_end(self, logs=None):
        if self._active:
            self._stop()

    def _stop(self):
        tf.profiler.experimental.stop()
        self._active = False


class EpochLine(keras.callbacks.Callback):
    """Prints one line per epoch: for workers that show no progress bar."""

    def __init__(self, task: str, epochs: int):
        super().__init__()
        self.task, self.epochs = task, epochs

    def on_epoch_end(self, epoch, logs=None):
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(user_view.values(logs).items()) if np.ndim(v) == 0)
        print(f"{self.task} epoch {epoch + 1}/{self.epochs} {metrics}", flush=True)


class ReportToRay(keras.callbacks.Callback):
    """Under Ray Train, `ray.train.report(logs)` at every epoch end, on every rank alike
    (Ray's report is a barrier); rank 0 may attach the model as a checkpoint with
    `checkpoint_every` epochs. For a user's own `fit` in a `train_loop_per_worker`."""

    def __init__(self, checkpoint_every: int = 0):
        super().__init__()
        self.checkpoint_every = checkpoint_every

    def on_epoch_end(self, epoch, logs=None):
        import ray.train  # pylint: disable=import-outside-toplevel  (only under Ray)

        metrics = {"epoch": epoch + 1, **user_view.values(logs)}
        every = self.checkpoint_every
        if not (every and (epoch + 1) % every == 0):
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if ray.train.get_context().get_world_rank() == 0:
                self.model.save(os.path.join(directory, "model.keras"))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=checkpoint)


class ScalarTensorBoard(keras.callbacks.TensorBoard):
    """Keras's `TensorBoard`, given the scalar logs only: a metric of several values
    (`F1Score`'s one per class) stays in the History and out of scalar summaries, which
    take one value each."""

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _scalars(logs))

    def on_train_batch_end(self, batch, logs=None):
        # Keras writes batch logs into the default summary writer, which with `update_freq="epoch"`
        # is not this callback's (it pushes none) but a user's TensorBoard's, if any.
        super().on_train_batch_end(batch, None if self.update_freq == "epoch" else _scalars(logs))

    def on_test_end(self, logs=None):
        super().on_test_end(_scalars(logs))


def _scalars(logs):
    return {k: v for k, v in (logs or {}).items() if np.ndim(v) == 0}
