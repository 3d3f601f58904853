"""A Keras user's timeseries model with a plain BatchNormalization under a live `distrib_tf.Run`.

    python tests/workers/moving_stats.py OUT [--without_fix]

The model normalizes its raw input (so a test can compute each replica's batch statistics
from the rows it knows), then a Conv1D; a layer of the user's own `assign`s the mean of its
input batch in `call`. After `fit` every worker writes every variable of the model into
`OUT/<task>.npz`; then, to show what Keras does alone, the same model trained by Keras's own
`fit` (no Run) under the same strategy, its moving statistics under `plain/`.
`--without_fix` takes `AverageReplicaState` out, to see a test fail.
"""

import argparse
import os

import keras
import numpy as np
import tensorflow as tf

import distrib_tf
from distrib_tf.keras import replica_state
from distrib_tf.run import routing

ROWS, STEPS, GLOBAL_BATCH, EPOCHS, MOMENTUM = 64, 6, 16, 2, 0.5


def make_data():
    """Rows whose scale grows with their index: two halves of a batch differ in their statistics."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, STEPS, 3)) * np.arange(1, ROWS + 1)[:, None, None] / 8 + np.arange(3)
    return x.astype("float32"), rng.normal(size=(ROWS, 1)).astype("float32")


class LastBatchMean(keras.layers.Layer):
    """Keeps the mean of the last batch it saw, per channel: a user's state assigned in `call`."""

    def build(self, input_shape):
        self.last = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False,
                                    name="last")

    def call(self, x, training=False):
        if training:
            self.last.assign(keras.ops.mean(x, axis=(0, 1)))
        return x


def build_model():
    model = keras.Sequential([
        keras.Input((STEPS, 3)),
        LastBatchMean(),
        keras.layers.BatchNormalization(momentum=MOMENTUM),
        keras.layers.Conv1D(4, 3, activation="relu"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--without_fix", action="store_true")
    args = parser.parse_args()
    if args.without_fix:
        replica_state.AverageReplicaState.on_train_batch_end = lambda self, batch, logs=None: None
    run = distrib_tf.Run(os.path.join(args.out, "run"), seed=0)
    keras.utils.set_random_seed(1)
    x, y = make_data()
    model = build_model()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)  # Run.fit.
    saved = {v.path: v.numpy() for v in model.variables}

    keras.utils.set_random_seed(1)
    plain = build_model()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with routing.plain_fit():  # Keras's own fit, the Run's strategy.
        plain.fit(dataset, epochs=EPOCHS, verbose=0)
    saved.update({f"plain/{v.path.split('/', 1)[1]}": v.numpy() for v in plain.non_trainable_weights})
    np.savez(os.path.join(args.out, run.task.replace(":", "_") + ".npz"), **saved)


if __name__ == "__main__":
    main()
