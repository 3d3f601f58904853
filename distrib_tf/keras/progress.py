"""Live progress of the job: events for the launcher, every worker's step time, stragglers.

In synchronous training every worker's step lasts as long as the slowest worker's: the
others wait in the gradient all-reduce. So the wall time of a step says nothing about
who is slow. `Progress` measures each worker's own time for a step: its wall time on the
host minus the time its step spent waiting on the gradient all-reduce. That wait is
measured inside the step by TensorFlow's own clock (`tf.timestamp`) once this worker's
last gradient is ready and again once the last reduced gradient is, and added up in a
variable (`distrib_tf.keras.local_sgd.time_all_reduce`): no host callback, and nothing
in the step waits for the clock. Every `window` steps the host reads that variable, and
one small all-reduce between two steps gives every worker the mean own step time of
every worker, which goes

- into the `progress` events (`distrib_tf.events`) that the launcher's status line shows;
- into the epoch's logs as `step_seconds_<task>` (so into TensorBoard and `summary.json`);
- into one warning line when a worker's time is above `ratio` times the median of the
  others' for `patience` windows in a row: a straggler, named once until it recovers.

It also writes the `train_begin` and `epoch` events. Use it as any Keras callback.
"""

import logging
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from distrib_tf import events
from distrib_tf.keras import local_sgd
from distrib_tf.keras import user_view

logger = logging.getLogger("distrib_tf")


def log_key(task: str) -> str:
    """The epoch-log key of a task's step time: `step_seconds_worker_1`."""
    return "step_seconds_" + task.replace(":", "_")


def stragglers(seconds: dict[str, float], ratio: float) -> dict[str, float]:
    """The tasks whose time is above `ratio` times the median of the others', with how much. Pure.

    Example:

        >>> stragglers({"worker:0": 0.1, "worker:1": 0.1, "worker:2": 0.31}, 1.5)
        {'worker:2': 3.1}
    """
    slow = {}
    for task, mine in seconds.items():
        others = [t for other, t in seconds.items() if other != task]
        if others and (median := statistics.median(others)) > 0 and mine > ratio * median:
            slow[task] = mine / median
    return slow


class Progress(keras.callbacks.Callback):
    """Events, per-worker step times and straggler warnings; see the module's docstring.

    Args:
        task: this worker, such as `worker:1`.
        workers: every training task, in the order of their replicas.
        epochs, steps_per_epoch, global_batch_size: the run's, for the status line.
        fit: which `fit` of the script this is (1-based), in each `epoch` event: a sweep keys
            its reports by it, since every fit numbers its epochs from 1.
        window: steps between two exchanges of the step times.
        ratio, patience: a straggler is `ratio` times slower for `patience` windows.
    """

    def __init__(self, *, task: str, workers: list[str], epochs: int, steps_per_epoch: int,
                 global_batch_size: int, fit: int = 1, window: int = 10, ratio: float = 1.5, patience: int = 3):
        super().__init__()
        self.task, self.workers = task, list(dict.fromkeys(workers))
        self.epochs, self.steps, self.batch, self.fit = epochs, steps_per_epoch, global_batch_size, fit
        self.window, self.ratio, self.patience = window, ratio, patience
        self.latest: dict[str, float] = {}  # Mean own step time of every worker, last window.
        self._epoch_times: dict[str, list[float]] = {}
        self._strikes = dict.fromkeys(self.workers, 0)
        self._named: set[str] = set()
        self._wall_sum = 0.0
        self._own_count = self._global = 0
        self._waited = None  # Seconds this worker's steps waited on the all-reduce, summed in the step.
        self._epoch = self._step = 0
        self._shown = self._epoch_start = self._begin = 0.0

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        local_replicas = self._local_replicas = strategy.num_replicas_in_sync // len(self.workers)
        self._instrument_step()

        @tf.function
        def gathered(row):
            def replica_fn():  # Each worker's row holds only its own time: the sum is every one.
                return tf.distribute.get_replica_context().all_reduce("SUM", tf.identity(row))
            return strategy.run(replica_fn)

        def exchange(own: float) -> dict[str, float]:
            row = np.zeros(len(self.workers), np.float32)
            row[self.workers.index(self.task)] = own / local_replicas
            total = strategy.experimental_local_results(gathered(tf.constant(row)))[0].numpy()
            return {task: float(t) for task, t in zip(self.workers, total)}

        self._exchange = exchange
        events.emit("train_begin", epochs=self.epochs, steps=self.steps, workers=len(self.workers))

    def _instrument_step(self):
        if self.model.jit_compile:  # XLA has no clock op: the wall time alone, then.
            return
        if self._waited is None:  # One per callback: a later fit may reuse the traced step.
            with tf.init_scope():  # The worker's own, outside any strategy's scope.
                self._waited = tf.Variable(0.0, dtype=tf.float64, trainable=False)
        self._waited.assign(0.0)
        local_sgd.time_all_reduce(self.model.optimizer, self._waited)

    def on_train_end(self, logs=None):
        local_sgd.time_all_reduce(self.model.optimizer, None)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._step = epoch, 0
        self._epoch_start = time.perf_counter()
        self._epoch_times = {task: [] for task in self.workers}

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self._wall_sum += now - self._begin
        self._own_count += 1
        self._step += 1
        self._global += 1
        if self._global % self.window == 0:
            self._exchange_times()
            self._watch_stragglers()
        if now - self._shown >= 1.0:
            self._shown = now
            rate = self._step / (now - self._epoch_start)  # Steps per second this epoch.
            left = (self.steps - self._step) + (self.epochs - self._epoch - 1) * self.steps
            events.emit("progress", epoch=self._epoch + 1, epochs=self.epochs, step=self._step,
                        steps=self.steps, examples_per_second=rate * self.batch,
                        eta_seconds=left / rate, worker_step_seconds=self.latest)

    def _exchange_times(self):
        """Every worker calls it at the same step: a collective."""
        waited = 0.0
        if self._waited is not None:  # Summed over this worker's replicas: each waited.
            waited = float(self._waited.read_value()) / self._local_replicas
            self._waited.assign(0.0)
        own = max(self._wall_sum - waited, 0.0) / self._own_count
        self.latest = self._exchange(own)
        self._wall_sum, self._own_count = 0.0, 0
        for task, seconds in self.latest.items():
            self._epoch_times.setdefault(task, []).append(seconds)

    def _watch_stragglers(self):
        slow = stragglers(self.latest, self.ratio)
        for task in self.workers:
            self._strikes[task] = self._strikes[task] + 1 if task in slow else 0
            if task not in slow:
                self._named.discard(task)
            elif self._strikes[task] >= self.patience and task not in self._named:
                self._named.add(task)
                others = statistics.median(t for w, t in self.latest.items() if w != task)
                if self.task == self.workers[0]:  # One line for the job.
                    logger.warning(
                        "straggler: %s's steps take %.1fx the median of the other workers' "
                        "(%.0f ms vs %.0f ms) for the last %d steps", task, slow[task],
                        1000 * self.latest[task], 1000 * others, self.patience * self.window)
                events.emit("straggler", straggler=task, ratio=slow[task],
                            step_seconds=self.latest[task], others_seconds=others)

    def on_epoch_end(self, epoch, logs=None):
        if self._own_count and not any(self._epoch_times.values()):  # An epoch under a window.
            self._exchange_times()
        if logs is not None:
            for task, seconds in self._epoch_times.items():
                if seconds:
                    logs[log_key(task)] = statistics.median(seconds)
        events.emit("epoch", epoch=epoch + 1, epochs=self.epochs, fit=self.fit,
                    metrics=user_view.values(logs))
