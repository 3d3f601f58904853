"""A small convolutional classifier: conv, group normalization, pooling, dense."""

import math

import keras


def build_cnn(*, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> keras.Model:
    """Three conv blocks (`width`, `width`, `2 * width` filters), global pooling, a dense head.

    Each convolution is normalized per example, over groups of channels
    (`GroupNormalization`, Wu and He 2018), not over the batch: the statistics of one
    example do not depend on which replica holds it or on how many replicas there are, so
    results do not depend on the layout, with no collective in the forward pass (a
    synchronized BatchNormalization all-reduces its statistics in every layer, forward
    and backward), and nothing to average or to hold apart under periodic sync.

    Example:

        >>> build_cnn(input_shape=(28, 28, 1), num_classes=10, width=8).count_params()
        2306
    """
    inputs = keras.Input(input_shape)
    x = inputs
    for filters, pool in ((width, False), (width, True), (2 * width, True)):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.GroupNormalization(groups=math.gcd(filters, 8))(x)
        x = keras.layers.ReLU()(x)
        if pool:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(2 * width, activation="relu")(x)
    # Logits in the variables' type: float32 under mixed precision, float64 in float64.
    outputs = keras.layers.Dense(num_classes, dtype=keras.config.dtype_policy().variable_dtype)(x)
    return keras.Model(inputs, outputs, name="cnn")
