"""What the user sees of a `fit` that distrib_tf resumed: one training, and nothing of ours.

- `HideOwnLogs`: distrib_tf's callbacks add figures to the logs (`epoch_seconds`,
  `examples_per_second`, `step_seconds_<task>`) and its NaN check logs
  `nonfinite_replicas`; they go to `summary.json`, events and distrib_tf's TensorBoard,
  never into the user's History, callbacks and progress bar.
- `Segments`: a stage resumed inside an epoch is two Keras `fit` calls (that epoch's
  remaining steps, then the rest); the user's callbacks see one training, their state
  restored (`callback_states`).
- `StageProgbar`: one progress bar with the stage's epoch numbers and steps, the resumed
  epoch counted from the step it resumed at.

A callback's state survives a restart when it has a pair of methods, `get_state()`
(returning a JSON-able dict) and `set_state(state)`; Keras's stateful callbacks
(`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint(save_best_only=True)`) have theirs
here. The state is what the callback holds after the step the backup is of.

Example:

    >>> class Counter(keras.callbacks.Callback):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.batches = 0
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         self.batches += 1
    ...     def get_state(self):
    ...         return {"batches": self.batches}
    ...     def set_state(self, state):
    ...         self.batches = state["batches"]
"""

import copy
import math

import keras
import numpy as np

OWN_KEYS = ("epoch_seconds", "examples_per_second")
OWN_PREFIXES = ("step_seconds_",)
OWN_METRIC = "nonfinite_replicas"

# Keras's stateful callbacks: the attributes that carry one epoch's decision to the next.
KERAS_STATES = (
    (keras.callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch")),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "best", "cooldown_counter")),
    (keras.callbacks.ModelCheckpoint, ("best",)),
)


def is_own_log(key: str) -> bool:
    """Whether an epoch's or a step's log `key` is distrib_tf's, not the user's model's."""
    key = key[len("val_"):] if key.startswith("val_") else key
    return key in OWN_KEYS or key.startswith(OWN_PREFIXES) or key == OWN_METRIC or key.endswith("_" + OWN_METRIC)


def value(v):
    """A log's value as JSON takes it: a float, or a list of floats for a metric of several
    values (`F1Score`'s one per class)."""
    return float(v) if np.ndim(v) == 0 else np.asarray(v, dtype="float64").tolist()


def values(logs) -> dict:
    """Every log's `value`."""
    return {k: value(v) for k, v in (logs or {}).items()}


def users_logs(logs) -> dict:
    """`logs` without distrib_tf's figures, as `value`s."""
    return {k: v for k, v in values(logs).items() if not is_own_log(k)}


class HideOwnLogs(keras.callbacks.Callback):
    """Takes distrib_tf's figures out of the logs, after distrib_tf's callbacks and before
    the user's (and Keras's History and progress bar). `epochs` keeps every epoch's whole
    logs (`summary.json`)."""

    def __init__(self):
        super().__init__()
        self.epochs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({"epoch": epoch + 1, **values(logs)})
        self._hide(logs)

    @staticmethod
    def _hide(logs):
        for key in [k for k in (logs or {}) if is_own_log(k)]:
            del logs[key]

    def on_train_batch_end(self, batch, logs=None):
        self._hide(logs)

    def on_test_batch_end(self, batch, logs=None):
        self._hide(logs)

    def on_test_end(self, logs=None):
        self._hide(logs)

    def on_train_end(self, logs=None):
        self._hide(logs)


def _float(value):
    if np.ndim(value):  # A monitored metric of several values (F1Score's, one a class): a list.
        return [_float(v) for v in np.ravel(value)]
    value = float(value)
    return value if math.isfinite(value) else repr(value)  # JSON has no inf: "inf", "-inf".


def _unfloat(value):
    if isinstance(value, list):
        return np.array([_unfloat(v) for v in value])
    return float(value) if isinstance(value, str) else value


def _opted_in(callback) -> bool:
    """Whether a callback keeps its own state across restarts (`get_state`/`set_state`)."""
    return hasattr(callback, "get_state") and hasattr(callback, "set_state")


def callback_states(callbacks) -> list:
    """Each callback's `[class name, state]` (`get_state()`, or Keras's own attributes; a
    state `None` where it has none): what a backup holds. A copy: the backup is written in
    the background, and a state may hold the callback's own lists, which go on changing."""
    states = []
    for callback in callbacks:
        if _opted_in(callback):
            state = copy.deepcopy(callback.get_state())
        else:
            names = next((names for kind, names in KERAS_STATES if isinstance(callback, kind)), ())
            state = {n: _float(getattr(callback, n)) for n in names if getattr(callback, n, None) is not None} or None
        states.append([type(callback).__name__, state])
    return states


def set_callback_states(callbacks, states) -> None:
    """Gives each callback the state `callback_states` recorded, in order, for as long as
    the callbacks' classes match those recorded (a list that changed keeps the rest fresh)."""
    for callback, (name, state) in zip(callbacks, states or ()):
        if type(callback).__name__ != name:
            return
        if state is None:
            continue
        if _opted_in(callback):
            callback.set_state(state)
            continue
        for attribute, value in state.items():
            setattr(callback, attribute, _unfloat(value))


def without_backup_and_restore(callbacks, task: str) -> list:
    """The user's callbacks but Keras's `BackupAndRestore`, which the run's backups replace
    (every worker, any step, any layout): loading its epoch's weights over the resumed step
    would train an epoch twice. Says so in one line."""
    kept = [c for c in callbacks if not isinstance(c, keras.callbacks.BackupAndRestore)]
    if len(kept) < len(callbacks):
        print(f"{task}: keras.callbacks.BackupAndRestore steps aside under distrib_tf.Run, whose backups do "
              "its work at every step on every worker (it is not called)", flush=True)
    return kept


def callback_arrays(callbacks) -> dict:
    """The arrays a callback's state holds beside its numbers: `EarlyStopping(
    restore_best_weights=True)`'s best weights, named `"<callback>_<weight>"` (a backup writes
    them in a file of their own, `distrib_tf.keras.backup`)."""
    return {f"{index}_{i}": np.asarray(w) for index, callback in enumerate(callbacks)
            if isinstance(callback, keras.callbacks.EarlyStopping) and callback.best_weights is not None
            for i, w in enumerate(callback.best_weights)}


def set_callback_arrays(callbacks, arrays: dict | None, task: str, states=None) -> None:
    """Gives each callback the arrays `callback_arrays` recorded; an `EarlyStopping` that
    restores its best weights but finds none in the backup (a state handed over by a peer)
    says so in one line. Only while the callbacks' classes match `states`' (as `set_callback_states`)."""
    recorded = set()
    for index, (callback, (name, _)) in enumerate(zip(callbacks, states or ())):
        if type(callback).__name__ != name:
            break
        recorded.add(index)
    for index, callback in enumerate(callbacks):
        if index not in recorded:  # Another list than the backup's from here (`set_callback_states`).
            return
        if isinstance(callback, keras.callbacks.EarlyStopping) and callback.restore_best_weights:
            weights = [arrays[k] for k in sorted((k for k in arrays or {} if k.startswith(f"{index}_")),
                                                 key=lambda k: int(k.split("_")[1]))]
            if weights:
                callback.best_weights = weights
            elif callback.best is not None and math.isfinite(callback.best):
                print(f"{task}: EarlyStopping(restore_best_weights=True) resumed without its best weights (they "
                      "are on another worker's disk): it restores the best epoch since this resume", flush=True)


class Segments(keras.callbacks.CallbackList):
    """The user's callbacks across the `fit` calls that make one stage (a resumed partial
    epoch, then the rest; a rollback): `on_train_begin` before the first, then the state
    they held at the step resumed (`states`), `on_train_end` after the last. They see the
    user's `fit`'s `params` (`epochs`, `steps` an epoch, `verbose`), not an inner fit's,
    and a resumed epoch's batches numbered from the step it resumed at (`skipped`)."""

    def __init__(self, callbacks, model, states=None, arrays=None, task="chief:0", params=None):
        super().__init__(list(callbacks), add_history=False, add_progbar=False, model=model)
        self.first, self.last, self.states, self.arrays, self.task = True, False, states, arrays, task
        self.users_params, self.skipped = params, 0

    def set_model(self, model):
        """Once a model: each `fit` of the stage calls it, and a callback's `set_model` may
        act once (`TensorBoard`'s takes its embeddings' metadata)."""
        if model is not getattr(self, "_model", None):
            super().set_model(model)

    def set_params(self, params):
        """The user's `fit`'s `params`, whichever inner fit gives its own."""
        super().set_params({**(params or {}), **(getattr(self, "users_params", None) or {})})  # (None in __init__.)

    def restore(self) -> None:
        """The callbacks' state at the step resumed, once: at the stage's first `fit`, or
        alone for a stage that came back finished (no `fit` ran: they hold the finished
        run's state, as after Keras's `fit`)."""
        if not self.first:
            return
        self.first = False
        if self.users_params:
            self.set_params({})
        set_callback_states(self.callbacks, self.states)
        if self.states:
            set_callback_arrays(self.callbacks, self.arrays, self.task, self.states)

    def on_train_begin(self, logs=None):
        if self.first:
            super().on_train_begin(logs)
            self.restore()

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch + self.skipped, logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch + self.skipped, logs)

    def on_train_end(self, logs=None):
        if self.last:
            super().on_train_end(logs)

    def on_epoch_end(self, epoch, logs=None):
        """Keras's, but on the caller's `logs` itself: what a callback adds to them
        (`ReduceLROnPlateau`'s `learning_rate`) reaches the History, as in Keras's own list."""
        if self._async_train:
            self._flush_futures()
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_epoch_end(epoch, logs)


class StageProgbar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar over a stage's epochs and steps, whichever `fit` call of the
    stage runs: "Epoch 2/3" and "9/14" in a stage resumed at step 8 of its second epoch."""

    def __init__(self, epochs: int, steps: int):
        super().__init__()
        self.stage_epochs, self.stage_steps, self.skipped = epochs, steps, 0

    def set_params(self, params):
        super().set_params({**params, "epochs": self.stage_epochs, "steps": self.stage_steps})

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch + self.skipped, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.skipped = 0
