"""State that layers update per replica, averaged over the replicas after every step.

Keras 3 on TensorFlow creates every variable with aggregation `"none"`: under a
`tf.distribute` strategy it is a `MirroredVariable` (synchronization ON_WRITE), and an
`assign` in a replica's step (`keras/src/backend/tensorflow/core.py`, `_initialize`) updates
only that replica's copy (TensorFlow's `_on_write_update_replica` with `NONE`). So each
replica keeps its own BatchNormalization moving mean and variance, from its own slice of the
batch, and so does any variable a layer `assign`s in `call`: the copies part at the first
step, and what a worker saves, evaluates or returns is its first replica's (reading a
`MirroredVariable` takes the primary copy). Trainable weights stay equal: the optimizer
applies all-reduced gradients. tf_keras made those moving statistics ON_READ with
aggregation MEAN: read outside a replica (a save, a checkpoint), they were the mean over
the replicas.

`AverageReplicaState` gives that mean, and keeps it one value everywhere: after every
training step one all-reduce (one vector per step, in the widest of the variables' float
types) replaces each such variable on every replica by the mean over all replicas. So the
state of every step is one value on every worker, whatever takes it (a backup at any step,
a preemption's, a checkpoint, validation, `fit`'s end, the user's save), and a resume at any
step continues exactly. The arithmetic: a moving average is linear, so the mean of the
replicas' moving averages (tf_keras's value) is the moving average of the replicas' mean
statistics, which is what averaging every step computes; the two differ by rounding only.
Without several replicas, or without such variables (the main job's GroupNormalization
models), nothing runs. Under periodic sync (`local_sgd.PeriodicSync`) the replicas part on
purpose and its own average of every weight covers them.

Which variables (`replica_variables`): floating-point variables of trainable layers that
are not trainable, not a `SeedGenerator`'s state, not a metric's or the optimizer's, with
aggregation `"none"` (a variable given another aggregation is TensorFlow's to combine).
The weights of a frozen layer (`trainable=False`) and the statistics of a
`BatchNormalization(synchronized=True)` (every replica assigns the same global value) are
left alone: they are one value already, and the mean of equal values is not always the
value (3 replicas: 3x/3 differs from x in the last bit for about 15% of float32 values).

Example:

    >>> model.fit(dataset, epochs=3, callbacks=[AverageReplicaState()])  # Run.fit adds it.
"""

import keras
import numpy as np
import tensorflow as tf


def replica_variables(model) -> list:
    """The variables of `model` that its layers may update per replica (see the module doc)."""
    frozen = {id(w) for layer in model._flatten_layers()  # pylint: disable=protected-access
              if not layer.trainable or getattr(layer, "synchronized", False) for w in layer.weights}
    return [v for v in model.non_trainable_weights
            if id(v) not in frozen and v.aggregation == "none" and tf.as_dtype(v.dtype).is_floating]


def make_average(strategy, variables):
    """A function that sets each of `variables` (Keras variables made under `strategy`) on
    every replica to its mean over all replicas: one all-reduce. Every worker must call it."""
    dtype = tf.float64 if any(tf.as_dtype(v.dtype) == tf.float64 for v in variables) else tf.float32
    sizes = [int(np.prod(v.shape)) for v in variables]

    @tf.function
    def average():
        def replica_fn():
            flat = tf.concat([tf.reshape(tf.cast(v.value, dtype), [-1]) for v in variables], 0)
            mean = tf.distribute.get_replica_context().all_reduce("MEAN", flat)
            for v, part in zip(variables, tf.split(mean, sizes)):
                v.value.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))  # This replica's copy.
        strategy.run(replica_fn)

    return average


class AverageReplicaState(keras.callbacks.Callback):
    """After every training step, each variable that layers update per replica (moving
    statistics) holds the mean over all replicas, on every replica (see the module doc).

    Put it before any callback that saves or reads the model at a step's end (backups,
    checkpoints); every worker must have it.
    """

    def __init__(self):
        super().__init__()
        self.variables, self._average = [], None

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        variables = replica_variables(self.model) if strategy.num_replicas_in_sync > 1 else []
        if [id(v) for v in variables] != [id(v) for v in self.variables]:
            self.variables = variables
            self._average = make_average(strategy, variables) if variables else None

    def on_train_batch_end(self, batch, logs=None):
        if self._average is not None:
            self._average()

    def __repr__(self):
        return f"AverageReplicaState(variables={len(self.variables)})"
