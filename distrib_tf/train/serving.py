"""The main job's trained model: `model.keras` and `serving/` (`distrib_tf.run.export`).

Example:

    >>> model = distrib_tf.train.serving.load_model("runs/cnn/model.keras")
    >>> served = tf.saved_model.load("runs/cnn/serving")
    >>> served.serve(images)
"""

from distrib_tf.run import export

KERAS_FILE = export.KERAS_FILE
SAVED_MODEL_DIR = export.SAVED_MODEL_DIR
weights_fingerprint = export.weights_fingerprint


def load_model(path: str, **kwargs):
    """`keras.models.load_model(path, **kwargs)` with distrib_tf's layers registered."""
    import keras  # pylint: disable=import-outside-toplevel

    from distrib_tf import models  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from distrib_tf.keras import nonfinite  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    return keras.models.load_model(path, **kwargs)


def export_model(model, model_dir: str) -> tuple[str, str]:
    """Writes `model.keras` and `serving/` under `model_dir` (the chief's, in the main job)."""
    return export.export_model(model, model_dir)
