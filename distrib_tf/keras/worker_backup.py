"""A worker's backups as training goes: `WorkerBackup`, the callback that takes this worker's
state at epoch ends, every `every_steps` steps and when asked (a preemption, a rollback),
and hands it to `distrib_tf.keras.backup` to write on its own disk, in the background.

The variables are the model's, its optimizer's and those of the optimizers it holds besides
(`distrib_tf.keras.held_optimizers`: a GAN's). What a backup holds beside the variables: the
resumed epoch's metric sums (`metric_sums`), the epochs' logs, the user's callbacks' states
and arrays, the rollbacks and the layout.
"""

import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

from distrib_tf import events
from distrib_tf.keras import backup
from distrib_tf.keras import held_optimizers
from distrib_tf.keras import steps as steps_lib
from distrib_tf.keras import user_view


def snapshot(variables) -> list:
    """The variables' values now, as tensors, without copying them: TensorFlow copies a
    variable's buffer when it is next updated while a tensor still refers to it, so the
    tensors keep this step's values. A step waits about a millisecond, whatever the
    model's size (measured: 1.3 ms for 400 MB; a copy into numpy took 0.1 to 0.7 s)."""
    return [tf.convert_to_tensor(v.value) for v in variables]


class WorkerBackup(keras.callbacks.Callback):
    """Saves this worker's training state into its own `directory`.

    Every worker runs it (unlike Keras's `BackupAndRestore`, which only the chief may
    write under `distrib_tf`): at every epoch end and, with `every_steps`, every
    `every_steps` global steps. The step waits while the state is taken (`snapshot`);
    the files are written in the background (`backup.WRITER`), the next backup waiting for the
    one before to be on the disk (at most one state held in memory besides the model's). `flush()` waits
    for it; `fit`'s end, a preemption and a rollback do.

    Args:
        directory: this worker's own backup directory (on its own disk).
        run: identifies the run; a backup of another run is never restored.
        task: this worker's name, for the metadata (e.g. `"worker:1"`).
        every_steps: also back up every this many global steps; `None`: epochs only.
        keep: how many backups to keep (at least 2, so that the workers always share
            one while a save is in progress on some of them).
        steps_per_epoch: global steps per epoch, to record the epoch of a step.
        history: the user's logs of the epochs already finished (`{"epoch": 1, "loss": ...}`),
            to which each epoch's end adds its own.
        layout: the layout's training tasks: once a step is backed up, the older backups
            beside it of tasks not in it are deleted (`retire_gone`). `None`: none are.
        rollbacks: the rollbacks so far (`{"at_step", "to_step", "learning_rate"}`), kept in
            every backup: a restart goes on with the learning rate and the count they left.
        asynchronous: write in the background (default); False: each save waits for its files.
        steps: the stage's step counter (`distrib_tf.keras.steps`); default: the optimizer's.
        epoch_end_saves: back up at every epoch's end here (default). False: the caller does,
            once every worker finished that end (`distrib_tf.keras.preemption.SaveOnPreemption`),
            and no backup of an epoch's last step comes before it.
    """

    def __init__(self, directory: str, *, run: str, task: str, steps_per_epoch: int,
                 every_steps: int | None = None, keep: int = 2, history: list | None = None,
                 callbacks=(), epoch_metrics: list | None = None, layout=None, rollbacks: list | None = None,
                 asynchronous: bool = True, steps: steps_lib.StageSteps | None = None,
                 epoch_end_saves: bool = True):
        super().__init__()
        self.directory, self.run, self.task = directory, run, task
        self.steps_per_epoch, self.every_steps, self.keep = steps_per_epoch, every_steps, max(keep, 2)
        self.steps = steps or steps_lib.StageSteps()
        self.step = 0  # The stage's global steps finished (`self.steps`).
        self.saved_step = None
        self.history = list(history or [])
        self.callbacks = list(callbacks)  # The user's: their states go into every backup.
        self._weights: dict = {}  # What the metadata says of the step's weights, once written.
        self.epoch_metrics = epoch_metrics  # The resumed epoch's metric sums so far, restored at its start.
        self.layout, self.retired_below = (None if layout is None else tuple(layout)), -1
        self.rollbacks = list(rollbacks or [])
        self.asynchronous = asynchronous
        self.blocked_seconds: list[float] = []  # What each save cost the step that made it.
        self.epoch_end_saves = epoch_end_saves
        self.before_last = None  # The state before an epoch's last execution, taken, not written.

    def on_train_begin(self, logs=None):
        self.step, self.before_last = self.steps(self.model), None
        if self.step == 0:
            self.save()  # The starting point, for a rollback before the first backup.

    def on_train_batch_end(self, batch, logs=None):
        before, self.step = self.step, self.steps(self.model)  # Once an execution: maybe several steps.
        if self.step == before and not getattr(self, "_said_still", False):
            self._said_still = True  # A train_step with optimizers of its own (a GAN's): say it once.
            why = ("the model has no trainable weights, so Keras applies no update" if not self.model.trainable_weights
                   else "a train_step that applies its own optimizers?")
            print(f"{self.task}: model.optimizer did not count this step ({why}): backups and a resume count steps "
                  f"by it, so they stay at step {self.step}; expected model.optimizer to apply the step's gradients",
                  flush=True)
        ends_epoch = not self.epoch_end_saves and self.step % self.steps_per_epoch == 0  # Its end backs it up.
        if self.every_steps and steps_lib.crossed(before, self.step, self.every_steps) and not ends_epoch:
            self.save()

    def on_train_batch_begin(self, batch, logs=None):
        """Before the execution that ends an epoch, its state is taken (not written): a SIGTERM
        in the epoch's end backs it up (`keep_before_last`), so that the restart runs that
        execution and the whole epoch's end again (a restart from the epoch's last step would
        start the next epoch, that end never made)."""
        if self.epoch_end_saves:
            return
        left = self.steps_per_epoch - self.step % self.steps_per_epoch
        self.before_last = self._take() if left <= (self.model.steps_per_execution or 1) else None

    def keep_before_last(self) -> int | None:
        """At an epoch's last step: backs up the state taken before its last execution, unless
        this worker's backup holds that step already; returns that step (`None`: none taken)."""
        taken, self.before_last = self.before_last, None
        if taken is not None and taken[0] != self.saved_step:
            backup.WRITER.wait()  # One state held at most.
            self._submit(taken)
        return None if taken is None else taken[0]

    def on_epoch_begin(self, epoch, logs=None):
        if self.epoch_metrics is not None:  # After Keras's reset: the epoch goes on from them.
            set_metric_sums(self.model, self.epoch_metrics)
            self.epoch_metrics = None

    def on_epoch_end(self, epoch, logs=None):
        self.history = [h for h in self.history if h["epoch"] <= epoch]
        self.history.append({"epoch": epoch + 1, **user_view.users_logs(logs)})
        if self.epoch_end_saves:
            self.save()

    def on_train_end(self, logs=None):
        self.flush()

    def flush(self) -> None:
        """Waits until every backup asked for is on the disk."""
        backup.WRITER.wait()

    def save(self):
        """Backs up the current step: its state copied now, its files written in the
        background (weights first, metadata last). A step already saved (at a batch's end,
        then its epoch's) gets its metadata written again: the epoch's logs and the
        callbacks' states came since."""
        started = time.perf_counter()
        backup.WRITER.wait()  # The backup before is whole on the disk: one state held at most.
        self._submit(self._take())
        self.blocked_seconds.append(time.perf_counter() - started)

    def _take(self) -> tuple:
        """The current step's backup, its state copied now (`snapshot`): what `_submit` writes."""
        step, arrays = self.step, None
        state = {}
        if self.saved_step != step:
            held = held_optimizers.describe(self.model)  # A GAN's own optimizers, once built.
            variables = backup.state_variables(self.model, held_optimizers.variables(self.model, held))
            arrays = snapshot(variables)
            state["variables"] = backup.describe_variables(variables)
            if held:
                state["optimizers"] = held
            if step % self.steps_per_epoch:  # Inside an epoch: the sums its History value needs.
                state["metrics"] = metric_sums(self.model)
        meta = {"run": self.run, "step": step, "epoch": step // self.steps_per_epoch, "task": self.task,
                "history": list(self.history), "callbacks": user_view.callback_states(self.callbacks),
                "stopped": bool(self.model.stop_training), "rollbacks": list(self.rollbacks),
                **({} if self.layout is None else {"layout": list(self.layout)})}
        held = user_view.callback_arrays(self.callbacks)  # EarlyStopping's best weights, as they are now.
        if held:
            meta["callback_arrays"] = os.path.basename(backup.callbacks_path(self.directory, step))
        return step, arrays, state, meta, held

    def _submit(self, taken: tuple) -> None:
        """Hands a backup `_take` made to the background writer."""
        step, arrays, state, meta, held = taken
        self.saved_step = step
        backup.WRITER.submit(lambda: self._write(step, arrays, state, meta, held))
        if not self.asynchronous:
            backup.WRITER.wait()

    def _write(self, step: int, arrays, state: dict, meta: dict, held: dict) -> None:
        """In the background: the variables (unless `arrays` is None: written already) and the
        callbacks' arrays, then the metadata, which makes the backup count; then the older
        backups go."""
        if arrays is not None:
            backup.make_private_dirs(self.directory)
            self._weights = {**backup.write_state(backup.state_path(self.directory, step), arrays), **state}
        if held:
            backup.write_arrays(backup.callbacks_path(self.directory, step), held)
        meta_path = backup.meta_path(self.directory, step)
        with open(meta_path + ".writing", "w", encoding="utf-8") as f:
            json.dump({**meta, **self._weights}, f)
            f.flush()
            os.fsync(f.fileno())
        backup.fsync(self.directory)  # The weights' rename is on the disk before the metadata's.
        os.replace(meta_path + ".writing", meta_path)
        backup.fsync(self.directory)
        events.emit("backup", step=step)
        for old in sorted(backup.metadata_of(self.directory), key=lambda m: m["step"])[: -self.keep]:
            backup.remove_step(self.directory, old["step"])  # (By their metadata: reading their weights back costs.)
        if self.layout is not None and step > self.retired_below:  # Older states of gone tasks.
            backup.retire_gone(self.directory, run=self.run, tasks=self.layout, below=step)
            self.retired_below = step


def metric_sums(model) -> list:
    """This worker's own share of every compiled metric's state (its replicas' parts of each
    on-read variable, as they are: no collective), for the epoch's History value."""
    strategy = model.distribute_strategy
    return [[np.asarray(part.numpy()).tolist() for part in strategy.experimental_local_results(v.value)]
            for v in model.metrics_variables]


def set_metric_sums(model, sums: list) -> None:
    """Restores `metric_sums` on the layout it was taken on (elsewhere the resumed epoch's
    value covers the steps after the resume only)."""
    strategy, variables = model.distribute_strategy, model.metrics_variables
    parts = [strategy.experimental_local_results(v.value) for v in variables]
    if len(sums) != len(parts) or any(len(a) != len(b) for a, b in zip(sums, parts)):
        return
    for saved, local in zip(sums, parts):
        for value, part in zip(saved, local):
            part.assign(np.asarray(value, dtype=part.dtype.as_numpy_dtype).reshape(part.shape))
