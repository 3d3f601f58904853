"""The callbacks of the main job: checkpoints, TensorBoard, timing, progress.

Every worker backs up its own state (`distrib_tf.keras.backup.WorkerBackup`); only the chief
writes what a user reads (`checkpoints/`, `logs/`). Keras's own `ModelCheckpoint`,
`BackupAndRestore` and `TensorBoard` are made chief-aware by `distrib_tf.keras.compat`,
so a user's own callbacks get the same behaviour.
"""

import logging
import os
import tempfile
import time

import keras
import tensorflow as tf

from distrib_tf.keras import backup

logger = logging.getLogger("distrib_tf")


def checkpoint_path(model_dir: str, epoch: int) -> str:
    """Where the chief writes the checkpoint of `epoch` (1-based)."""
    return os.path.join(model_dir, "checkpoints", f"epoch{epoch:03d}.weights.h5")


class ChiefCheckpoint(keras.callbacks.Callback):
    """The chief writes `checkpoints/epochNNN.weights.h5` at every epoch end, atomically.

    The weights go to a temporary file that is then renamed, so a side-car evaluator
    never reads a checkpoint half-written; then `epochNNN.json` names the run (`run`),
    so that it never takes an earlier run's checkpoint in the same directory for this
    one's. Other workers write nothing (Keras 3 saving runs no collectives).
    """

    def __init__(self, model_dir: str, run: str = ""):
        super().__init__()
        self.model_dir, self.run = model_dir, run

    def on_epoch_end(self, epoch, logs=None):
        if not self.model.distribute_strategy.extended.should_checkpoint:
            return
        path = checkpoint_path(self.model_dir, epoch + 1)
        backup.make_private_dirs(os.path.dirname(path))
        writing = path[: -len(".weights.h5")] + ".writing.weights.h5"
        self.model.save_weights(writing, overwrite=True)
        backup.fsync(writing)
        os.replace(writing, path)
        backup.fsync(os.path.dirname(path))
        backup.write_json_atomically(checkpoint_run_path(path), {"run": self.run, "epoch": epoch + 1})


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
        self._step = int(self.model.optimizer.iterations.numpy())

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
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted((logs or {}).items()))
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

        metrics = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
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
