"""The main job: our reference training job, built on the library (`distrib_tf.keras`).

`python -m distrib_tf.train` runs it (`distrib_tf.train.cli`); `train_and_evaluate` is the
same job as a function. Names that need TensorFlow are imported on first use, so that a
notebook or a sweep can build a `TrainConfig` without it.
"""

import importlib

from distrib_tf.train.config import TrainConfig

__all__ = [
    "TrainConfig",
    "train_and_evaluate",
]


def __getattr__(name):
    if name == "train_and_evaluate":
        return importlib.import_module("distrib_tf.train.job").train_and_evaluate
    raise AttributeError(f"module 'distrib_tf.train' has no attribute {name!r}")
