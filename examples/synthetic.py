"""Synthetic stand-ins for the datasets keras.io's examples download (this machine has no
internet): the same shapes and types, and a signal a model can learn."""

import numpy as np


def load_digits(train: int = 2048, test: int = 512, seed: int = 0):
    """Like `keras.datasets.mnist.load_data()`: uint8 28x28 images, labels 0-9, where a
    digit is a bright square at a place of its own."""
    rng = np.random.default_rng(seed)

    def split(rows):
        labels = rng.integers(0, 10, rows)
        images = rng.integers(0, 60, (rows, 28, 28)).astype("uint8")
        for i, label in enumerate(labels):
            row, col = divmod(int(label), 5)
            images[i, 4 + 10 * row: 12 + 10 * row, 1 + 5 * col: 6 + 5 * col] = 255
        return images, labels.astype("uint8")

    return split(train), split(test)


def load_reviews(train: int = 1024, test: int = 256, vocab_size: int = 2000, maxlen: int = 64, seed: int = 0):
    """Like `keras.datasets.imdb.load_data()` padded to `maxlen`: int token ids, labels 0/1,
    where a positive review holds more tokens from the top of the vocabulary."""
    rng = np.random.default_rng(seed)

    def split(rows):
        labels = rng.integers(0, 2, rows)
        tokens = rng.integers(1, vocab_size, (rows, maxlen))
        bias = rng.random((rows, maxlen)) < 0.2
        tokens[bias & (labels[:, None] == 1)] = rng.integers(1, 50, int((bias & (labels[:, None] == 1)).sum()))
        return tokens.astype("int32"), labels.astype("int32")

    return split(train), split(test)
