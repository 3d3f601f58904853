"""Periodic sync, and an Inf gradient on worker:1 alone, at one step, with a finite loss.

    nan_between_syncs.py OUT

Between syncs each worker applies its own gradient, so at step `SPIKE` only worker:1's
weights turn non-finite; the loss of that step (computed before the update) is finite
on both. Every worker must stop at that same step. Each process writes OUT/<task>.json:
the step it stopped at and the culprits it named, or that it finished.
"""

import json
import sys

import numpy as np

import distrib_tf

strategy = distrib_tf.make_strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from distrib_tf.keras import nonfinite  # noqa: E402
from distrib_tf.keras.local_sgd import PeriodicSync  # noqa: E402

GLOBAL_BATCH, STEPS, SPIKE = 16, 12, 6


class Spike(keras.layers.Layer):
    """The identity, whose gradient is multiplied by `factor`: a variable of this process."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        factor = self.factor

        @tf.custom_gradient
        def spike(v):
            return tf.identity(v), lambda g: g * tf.cast(factor, g.dtype)

        return spike(x)


class ArmAt(keras.callbacks.Callback):
    """Sets `factor` to Inf for one step: the gradient below the spike becomes Inf."""

    def __init__(self, factor, step):
        super().__init__()
        self.factor, self.step = factor, step

    def on_train_batch_begin(self, batch, logs=None):
        self.factor.assign(np.inf if batch + 1 == self.step else 1.0)


def main():
    out = sys.argv[1]
    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type}:{resolver.task_id}"
    workers = [f"worker:{i}" for i in range(strategy.num_replicas_in_sync)]
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    with tf.init_scope():
        factor = tf.Variable(1.0, trainable=False)  # This process's own, outside the strategy.
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  Spike(factor), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=[nonfinite.NonFiniteReplicas()])
    callbacks = [PeriodicSync(strategy, every=4),
                 nonfinite.StopOnNonFinite(workers=workers, steps_per_epoch=STEPS)]
    if task == "worker:1":
        callbacks.append(ArmAt(factor, SPIKE))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH)
    record = {"task": task}
    try:
        model.fit(dataset, epochs=1, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0)
        record["finished"] = True
    except nonfinite.NonFiniteLoss as e:
        record.update(stopped_at=e.step, culprits=e.culprits, message=str(e),
                      weights_finite=[bool(np.isfinite(w).all()) for w in model.get_weights()])
    with open(f"{out}/{task.replace(':', '_')}.json", "w", encoding="utf-8") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
