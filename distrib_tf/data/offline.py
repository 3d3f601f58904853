"""The offline default datasets, drawn by numpy from fixed seeds: no download, anywhere.

- `shapes`: 28x28 images of 10 kinds of shape at jittered places, with noise (the CNN's);
- `tokens`: sequences of 64 tokens whose class is the most frequent of 4 marker tokens
  (the transformer's).

`make_shapes(split)` and `make_tokens(split)` return `(inputs, labels)` as arrays; the
same on every machine and every call. This module imports no TensorFlow.
"""

import numpy as np

SHAPES_SIZE = 28
SHAPES_SPLITS = {"train": 8192, "test": 2048}
TOKENS_SPLITS = {"train": 8192, "test": 2048}
TOKENS_LEN = 64
TOKENS_VOCAB = 1000
TOKENS_MARKERS = (1, 2, 3, 4)


def _draw_shape(kind: int, rng: np.random.Generator) -> np.ndarray:
    """One 28x28 image of shape `kind` (0..9) at a jittered place, with noise."""
    n = SHAPES_SIZE
    yy, xx = np.mgrid[:n, :n].astype(np.float32)
    cy, cx = rng.uniform(10, 18, size=2)
    r = rng.uniform(5, 8)
    dy, dx = yy - cy, xx - cx
    masks = [
        np.abs(dy) < 1.5,                                   # horizontal bar
        np.abs(dx) < 1.5,                                   # vertical bar
        np.abs(dy - dx) < 1.5,                              # diagonal
        np.abs(dy + dx) < 1.5,                              # anti-diagonal
        (np.abs(dy) < 1.5) | (np.abs(dx) < 1.5),            # cross
        np.abs(np.hypot(dy, dx) - r) < 1.2,                 # ring
        np.hypot(dy, dx) < r,                               # disc
        (np.maximum(np.abs(dy), np.abs(dx)) < r)
        & (np.maximum(np.abs(dy), np.abs(dx)) > r - 2),     # square outline
        np.maximum(np.abs(dy), np.abs(dx)) < r,             # filled square
        (dy > -r) & (dy < r) & (np.abs(dx) < (dy + r) / 2), # triangle
    ]
    inside = masks[kind] & (np.abs(dy) < r + 3) & (np.abs(dx) < r + 3)
    image = inside * rng.uniform(0.6, 1.0) + rng.normal(0, 0.25, size=(n, n))
    return image.astype(np.float32)[..., None]


def make_shapes(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The `shapes` images and labels of `split` (`train` or `test`)."""
    rng = np.random.default_rng({"train": 1, "test": 2}[split])
    labels = rng.integers(0, 10, size=SHAPES_SPLITS[split])
    images = np.stack([_draw_shape(int(k), rng) for k in labels])
    return images, labels.astype(np.int64)


def make_tokens(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The `tokens` sequences and labels of `split` (`train` or `test`)."""
    rng = np.random.default_rng({"train": 3, "test": 4}[split])
    count = TOKENS_SPLITS[split]
    tokens = rng.integers(len(TOKENS_MARKERS) + 1, TOKENS_VOCAB, size=(count, TOKENS_LEN))
    labels = rng.integers(0, len(TOKENS_MARKERS), size=count)
    for row, label in enumerate(labels):
        counts = rng.multinomial(12, [0.25] * len(TOKENS_MARKERS))
        counts[label] += 4  # The labelled marker is the most frequent.
        markers = np.repeat(np.array(TOKENS_MARKERS), counts)
        tokens[row, rng.choice(TOKENS_LEN, size=len(markers), replace=False)] = markers
    return tokens.astype(np.int32), labels.astype(np.int64)
