"""distrib_tf: data-parallel training with TensorFlow and Keras, on one device or many.

Names that need TensorFlow are imported on first use, so that `distrib_tf.cluster` and
the launcher start without it.

Example:

    >>> import distrib_tf
    >>> run = distrib_tf.Run("runs/mine")  # Reads TF_CONFIG when it is set.
    >>> ...  # The Keras script as it is: its model.fit(...) gets every guarantee.
"""

import importlib as _importlib
import logging as _logging

from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import ClusterSpecError
from distrib_tf.cluster import Task
from distrib_tf.cluster import load_tf_config
from distrib_tf.cluster import speaks as _speaks
from distrib_tf.trial import params
from distrib_tf.versions import warn_if_untested as _warn_if_untested

__version__ = "0.1.0"

__all__ = [
    "ClusterSpec",
    "ClusterSpecError",
    "Task",
    "load_tf_config",
    "params",
    "Run",
    "data",
    "make_strategy",
    "describe_strategy",
    "TrainConfig",
    "train_and_evaluate",
    "log_to_stderr",
    # What a script may catch (each also ends a run with its exit code: distrib_tf.run.ending).
    "InvalidRun",
    "Preempted",
    "NonFiniteLoss",
    "ResumeError",
    "Pruned",
]

_LAZY = {
    "Run": "distrib_tf.run",
    "make_strategy": "distrib_tf.strategy",
    "describe_strategy": "distrib_tf.strategy",
    "TrainConfig": "distrib_tf.train.config",
    "train_and_evaluate": "distrib_tf.train.job",
    "InvalidRun": "distrib_tf.run.ending",
    "Preempted": "distrib_tf.keras.sigterm",
    "NonFiniteLoss": "distrib_tf.keras.nonfinite",
    "ResumeError": "distrib_tf.keras.resume",
    "Pruned": "distrib_tf.keras.pruning",
}

# A library leaves handlers to the application; the CLIs call `log_to_stderr()`.
_logging.getLogger("distrib_tf").addHandler(_logging.NullHandler())
# One warning outside the TensorFlow versions tested (distrib_tf.versions); TensorFlow is not imported.
_warn_if_untested()


def log_to_stderr(level: int | None = None) -> None:
    """Shows distrib_tf's messages as `distrib_tf: ...` lines on stderr (what the CLIs do).

    For a script or notebook that wants them too; idempotent. By default INFO on the
    process that speaks for the job (`distrib_tf.cluster.speaks`: the chief, or every
    worker with `DISTRIB_TF_VERBOSE=1`), WARNING on the others.
    """
    if level is None:
        level = _logging.INFO if _speaks() else _logging.WARNING
    logger = _logging.getLogger("distrib_tf")
    if not any(getattr(h, "_distrib_tf", False) for h in logger.handlers):
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("distrib_tf: %(message)s"))
        handler._distrib_tf = True  # pylint: disable=protected-access
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # Not also through absl's handler on the root logger.


def __getattr__(name):
    if name == "data":  # The subpackage, for `distrib_tf.data.from_arrays(...)` after `import distrib_tf`.
        return _importlib.import_module("distrib_tf.data")
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distrib_tf' has no attribute {name!r}")


def __dir__():
    """The public names, the lazy ones included (they are imported on first use)."""
    return sorted([*__all__, "__version__"])
