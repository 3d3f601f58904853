"""distrib_tf's own figures in the logs of a `fit`, and taking them out of the user's view.

distrib_tf's callbacks add figures to each epoch's logs (`epoch_seconds`,
`examples_per_second`, `step_seconds_<task>`) and its NaN check logs `nonfinite_replicas`;
they go to `summary.json`, events and distrib_tf's TensorBoard, never into what the
user's History, callbacks and progress bar see (`HideOwnLogs`).
"""

import keras

OWN_KEYS = ("epoch_seconds", "examples_per_second")
OWN_PREFIXES = ("step_seconds_",)


def is_own_log(key: str, own_metric: str = "nonfinite_replicas") -> bool:
    """Whether an epoch's or a step's log `key` is distrib_tf's, not the user's model's."""
    key = key[len("val_"):] if key.startswith("val_") else key
    return key in OWN_KEYS or key.startswith(OWN_PREFIXES) or key == own_metric or key.endswith("_" + own_metric)


class HideOwnLogs(keras.callbacks.Callback):
    """Takes distrib_tf's figures out of the logs, after distrib_tf's callbacks and before
    the user's (and Keras's History and progress bar): what the user's objects hold is what
    plain Keras gives. `epochs` keeps every epoch's whole logs (`summary.json`)."""

    def __init__(self):
        super().__init__()
        self.epochs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}})
        self._hide(logs)

    def _hide(self, logs, *args):
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




def users_logs(logs) -> dict:
    """`logs` without distrib_tf's figures, as floats."""
    return {k: float(v) for k, v in (logs or {}).items() if not is_own_log(k)}


class Segments(keras.callbacks.CallbackList):
    """The user's callbacks across the `fit` calls that make one stage (a resumed partial
    epoch, then the rest; a rollback): `on_train_begin` before the first, `on_train_end`
    after the last, as one uninterrupted `fit` calls them."""

    def __init__(self, callbacks, model):
        super().__init__(list(callbacks), add_history=False, add_progbar=False, model=model)
        self.first, self.last = True, False

    def on_train_begin(self, logs=None):
        if self.first:
            self.first = False
            super().on_train_begin(logs)

    def on_train_end(self, logs=None):
        if self.last:
            super().on_train_end(logs)
