"""A small convolutional classifier: conv, batch norm, pooling, dense."""

import keras


def build_cnn(*, input_shape: tuple[int, ...], num_classes: int, width: int = 32,
              synchronized_bn: bool = True) -> keras.Model:
    """Three conv blocks (`width`, `width`, `2 * width` filters), global pooling, a dense head.

    `synchronized_bn=False` normalizes over each replica's own batch: what periodic
    averaging needs, where replicas train apart between synchronizations.

    Example:

        >>> build_cnn(input_shape=(28, 28, 1), num_classes=10, width=8).count_params()
        2370
    """
    inputs = keras.Input(input_shape)
    x = inputs
    for filters, pool in ((width, False), (width, True), (2 * width, True)):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        # Synchronized: statistics of the global batch, so results do not depend on the
        # layout. Momentum 0.9: short runs, stats settle fast.
        x = keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized_bn)(x)
        x = keras.layers.ReLU()(x)
        if pool:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(2 * width, activation="relu")(x)
    # Logits in the variables' type: float32 under mixed precision, float64 in float64.
    outputs = keras.layers.Dense(num_classes, dtype=keras.config.dtype_policy().variable_dtype)(x)
    return keras.Model(inputs, outputs, name="cnn")
