"""The trained model, in the two forms users load: `model.keras` and a SavedModel.

The chief writes, under `model_dir`:

- `model.keras`: the whole Keras model (architecture, weights, optimizer state), for
  `load_model()` here, which is `keras.models.load_model` with distrib_tf's own layers
  (`distrib_tf.models`) and metric (`distrib_tf.keras.nonfinite.NonFiniteReplicas`) registered;
- `serving/`: a SavedModel with one `serve` endpoint (`model.export`), for TensorFlow
  Serving, `tf.saved_model.load` or TFLite conversion, with no distrib_tf needed.

Each is written beside its final name and renamed into place, so a reader never sees a
half-written model.

Example:

    >>> model = distrib_tf.train.serving.load_model("runs/cnn/model.keras")
    >>> served = tf.saved_model.load("runs/cnn/serving")
    >>> served.serve(images)
"""

import hashlib
import os
import shutil

from distrib_tf.keras import backup

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "serving"


def load_model(path: str, **kwargs):
    """`keras.models.load_model(path, **kwargs)` with distrib_tf's layers and metric registered."""
    import keras  # pylint: disable=import-outside-toplevel

    from distrib_tf import models  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from distrib_tf.keras import nonfinite  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    return keras.models.load_model(path, **kwargs)


def export_model(model, model_dir: str) -> tuple[str, str]:
    """Writes `model.keras` and `serving/` under `model_dir`; returns their paths."""
    keras_path = os.path.join(model_dir, KERAS_FILE)
    partial = os.path.join(model_dir, f".partial.{KERAS_FILE}")
    model.save(partial)
    backup.fsync(partial)
    os.replace(partial, keras_path)
    serving = os.path.join(model_dir, SAVED_MODEL_DIR)
    partial = os.path.join(model_dir, f".partial.{SAVED_MODEL_DIR}")
    shutil.rmtree(partial, ignore_errors=True)
    model.export(partial, verbose=False)
    for folder, _, files in os.walk(partial):  # On the disk before the rename makes it the model.
        for name in [*files, "."]:
            backup.fsync(os.path.join(folder, name))
    shutil.rmtree(serving, ignore_errors=True)
    os.replace(partial, serving)
    backup.fsync(model_dir)
    return keras_path, serving


def weights_fingerprint(model) -> str:
    """The first 16 hex digits of the sha256 of every weight's bytes, in order."""
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
