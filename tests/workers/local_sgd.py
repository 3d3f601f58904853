"""A Keras user's model under periodic averaging, recording its weights around each sync.

    local_sgd.py OUT SYNC OPTIMIZER [DTYPE]

SYNC: `step` (synchronous training) or `every:N`; OPTIMIZER: `sgd`, `momentum` or `adam`;
DTYPE: `float32` (default) or `float64`, the model's.
Each process writes OUT/<task>.json: the fingerprint of its weights just before and just
after each sync, and its final weights.
"""

import hashlib
import json
import os
import sys

import numpy as np

import distrib_tf

strategy = distrib_tf.make_strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from distrib_tf.keras.local_sgd import PeriodicSync  # noqa: E402

GLOBAL_BATCH, STEPS = 16, 12


def fingerprint(model):
    return hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]


class RecordingSync(PeriodicSync):
    def synchronize(self, outer_step=True):
        self.record.append({"before": fingerprint(self.model)})
        super().synchronize(outer_step)
        self.record[-1]["after"] = fingerprint(self.model)


def main():
    out, sync, optimizer = sys.argv[1], sys.argv[2], sys.argv[3]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
    keras.config.set_floatx(dtype)
    resolver = getattr(strategy, "cluster_resolver", None)
    task = f"{resolver.task_type}_{resolver.task_id}" if resolver and resolver.task_type else "single"
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype(dtype)
    y = (x @ rng.normal(size=(6, 1))).astype(dtype)

    def dataset_fn(context):  # Global batches in order; each replica takes its own slice.
        per_replica = context.get_per_replica_batch_size(GLOBAL_BATCH)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        start = context.input_pipeline_id * per_replica
        return data.map(lambda a, b: (a[start:start + per_replica], b[start:start + per_replica]))

    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer={"sgd": keras.optimizers.SGD(0.05),
                                 "momentum": keras.optimizers.SGD(0.05, momentum=0.9),
                                 "adam": keras.optimizers.Adam(0.01)}[optimizer], loss="mse")
    callbacks = []
    if sync != "step":
        callbacks = [RecordingSync(strategy, every=int(sync.split(":")[1]))]
        callbacks[0].record = []
    model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1, steps_per_epoch=STEPS,
              callbacks=callbacks, verbose=0)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{task}.json"), "w") as f:
        json.dump({"pid": int(os.readlink("/proc/self")), "syncs": callbacks[0].record if callbacks else [],
                   "weights": [np.asarray(w).tolist() for w in model.get_weights()],
                   "trainable": [np.asarray(w).tolist() for w in model.trainable_weights]}, f)


if __name__ == "__main__":
    main()
