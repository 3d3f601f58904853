"""A Keras of another version whose private modules moved: distrib_tf still imports and trains.

Removes `keras.src.backend.tensorflow.trainer` and `.optimizer` from reach (an import of
them raises ImportError) and reports version 3.99.0, then imports distrib_tf, trains a
small model on one device with the per-step callbacks, and tries periodic sync. Prints one
JSON line: what happened.
"""

import json
import logging
import sys

import keras
import keras.src.backend.tensorflow as backend  # The private package to empty.
import numpy as np

for name in ("trainer", "optimizer"):
    delattr(backend, name)
    sys.modules[f"keras.src.backend.tensorflow.{name}"] = None  # `import` now raises ImportError.
keras.__version__ = "3.99.0"


class Count(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


warnings = Count()
logging.getLogger("distrib_tf").addHandler(warnings)

import distrib_tf  # noqa: E402
from distrib_tf.keras import local_sgd  # noqa: E402
from distrib_tf.keras import nonfinite  # noqa: E402
from distrib_tf.keras import progress  # noqa: E402

strategy = distrib_tf.make_strategy("one_device")
distrib_tf.make_strategy("one_device")  # Warned once, not twice.
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=[nonfinite.NonFiniteReplicas()])
x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
history = model.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[
    progress.Progress(task="chief:0", workers=["chief:0"], epochs=1, steps_per_epoch=4, global_batch_size=8),
    nonfinite.StopOnNonFinite(workers=["chief:0"], steps_per_epoch=4)])
try:
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[local_sgd.PeriodicSync(strategy, every=2)])
    periodic = "ran"
except local_sgd.UnsupportedKeras as e:
    periodic = str(e)
print(json.dumps({"loss": history.history["loss"], "warnings": warnings.lines, "periodic_sync": periodic}))
