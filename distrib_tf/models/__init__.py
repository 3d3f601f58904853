"""Model builders by name. They know nothing of strategies: build them under a scope.

Example:

    >>> model = build_model("cnn", input_shape=(28, 28, 1), num_classes=10)
"""

from distrib_tf.models.cnn import build_cnn
from distrib_tf.models.transformer import build_transformer

__all__ = [
    "MODELS",
    "build_cnn",
    "build_model",
    "build_transformer",
]

MODELS = {"cnn": build_cnn, "transformer": build_transformer}


def build_model(name: str, **kwargs):
    """Builds the model registered as `name` with the builder's keyword arguments."""
    if name not in MODELS:
        raise ValueError(
            f"Invalid value for `--model`. Received: {name!r}. Expected one of {', '.join(MODELS)}."
        )
    return MODELS[name](**kwargs)
