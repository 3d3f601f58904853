"""The trained model, in the two forms users load: `model.keras` and a SavedModel.

The chief writes, under `model_dir`:

- `model.keras`: the whole Keras model (architecture, weights, optimizer state), for
  `keras.models.load_model` in Python. The main job compiles its model with one metric of
  its own (`distrib_tf.nonfinite.NonFiniteReplicas`): import `distrib_tf.nonfinite` first,
  or load with `compile=False` for inference;
- `serving/`: a SavedModel with one `serve` endpoint (`model.export`), for TensorFlow
  Serving, `tf.saved_model.load` or TFLite conversion, with no distrib_tf needed.

Each is written beside its final name and renamed into place, so a reader never sees a
half-written model.

Example:

    >>> import distrib_tf.nonfinite  # Registers the main job's metric.
    >>> model = keras.models.load_model("runs/cnn/model.keras")
    >>> served = tf.saved_model.load("runs/cnn/serving")
    >>> served.serve(images)
"""

import hashlib
import os
import shutil

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "serving"


def export_model(model, model_dir: str) -> tuple[str, str]:
    """Writes `model.keras` and `serving/` under `model_dir`; returns their paths."""
    keras_path = os.path.join(model_dir, KERAS_FILE)
    partial = os.path.join(model_dir, f".partial.{KERAS_FILE}")
    model.save(partial)
    os.replace(partial, keras_path)
    serving = os.path.join(model_dir, SAVED_MODEL_DIR)
    partial = os.path.join(model_dir, f".partial.{SAVED_MODEL_DIR}")
    shutil.rmtree(partial, ignore_errors=True)
    model.export(partial, verbose=False)
    shutil.rmtree(serving, ignore_errors=True)
    os.replace(partial, serving)
    return keras_path, serving


def weights_fingerprint(model) -> str:
    """The first 16 hex digits of the sha256 of every weight's bytes, in order."""
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
