"""The trained model, in the two forms users load: `model.keras` and a SavedModel.

- `model.keras`: the whole Keras model (architecture, weights, optimizer state). The run
  API's checks are not in its compile configuration (`distrib_tf.keras.nonfinite.attach`),
  so `keras.models.load_model` reads it in a process that never imports distrib_tf
  (a model of custom layers needs those layers importable, as always in Keras);
- `serving/`: a SavedModel with one `serve` endpoint (`model.export`), for TensorFlow
  Serving, `tf.saved_model.load` or TFLite conversion.

Each is written beside its final name and renamed into place, so a reader never sees a
half-written model.

Example:

    >>> export_model(model, "runs/mine")
    ('runs/mine/model.keras', 'runs/mine/serving')
"""

import hashlib
import os
import shutil

from distrib_tf.keras import backup

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "serving"


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
