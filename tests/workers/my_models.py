"""A Keras user's own model and data, as a user writes them: nothing here knows distrib_tf's
internals. Two inputs (a dict), two outputs (a float target and a class), AdamW under a
LearningRateSchedule.

- `build(info)`: the model, compiled (`--model=tests.workers.my_models:build`);
- `splits()`: the data from arrays (`--dataset=tests.workers.my_models:splits`).
"""

import keras
import numpy as np

import distrib_tf

ROWS, FEATURES, META, KINDS = 512, 6, 3, 4


def arrays(rows: int = ROWS, seed: int = 0):
    """`({"features", "meta"}, {"value", "kind"})`: a float target and a class, from the inputs."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(rows, FEATURES))
    meta = rng.normal(size=(rows, META))
    weights = np.random.default_rng(42).normal(size=FEATURES)  # The same relation in every split.
    value = features @ weights + 0.5 * meta[:, 0] + 0.1 * rng.normal(size=rows)
    kind = (np.abs(features[:, 0] * 2 + meta[:, 1]).astype(np.int64)) % KINDS
    return {"features": features, "meta": meta}, {"value": value, "kind": kind}


def splits():
    x, y = arrays()
    xv, yv = arrays(128, seed=1)
    return {"train": distrib_tf.data.from_arrays(x, y), "validation": distrib_tf.data.from_arrays(xv, yv)}


def build(info=None, *, total_steps: int = 1000):  # pylint: disable=unused-argument
    features = keras.Input((FEATURES,), name="features")
    meta = keras.Input((META,), name="meta")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([features, meta]))
    value = keras.layers.Dense(1, name="value")(hidden)
    kind = keras.layers.Dense(KINDS, name="kind")(hidden)
    model = keras.Model({"features": features, "meta": meta}, {"value": value, "kind": kind})
    schedule = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=total_steps, warmup_target=None)
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-3),
        loss={"value": "mse", "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        metrics={"value": ["mae"], "kind": ["accuracy"]},
    )
    return model
