"""Two strategies on 2 logical CPU devices, one after the other in one process (a notebook
cell run twice), each all-reducing what the other did not.

    python two_runs.py tensorflow   # two tf.distribute.MirroredStrategy: prints TensorFlow's error
    python two_runs.py runs DIR     # two distrib_tf.Run fits: prints each History's loss

Prints one JSON line.
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import distrib_tf


def _summed(strategy, dtype):
    """Ones of `dtype`, all-reduced over `strategy`'s replicas."""

    @tf.function
    def summed():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([3], dtype)))

    return summed()


def tensorflow_alone():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    for dtype in (tf.float32, tf.float64):
        strategy = tf.distribute.MirroredStrategy(devices)
        try:
            strategy.experimental_local_results(_summed(strategy, dtype))
        except tf.errors.OpError as error:
            return {"error": next(line for line in error.message.splitlines() if "Collective instance" in line)}
    return {"error": None}


def two_runs(directory):
    losses = []
    for cell in range(2):
        with distrib_tf.Run(f"{directory}/cell-{cell}", strategy="mirrored", cpu_replicas=2):
            hidden = [keras.layers.Dense(3)] * cell  # The second cell's model another: its keys fall elsewhere.
            model = keras.Sequential([keras.Input((4,)), *hidden, keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
            x = np.arange(32, dtype="float32").reshape(8, 4) / 32
            history = model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0)
        losses.append(history.history["loss"])
    return {"losses": losses}


if __name__ == "__main__":
    print(json.dumps(tensorflow_alone() if sys.argv[1] == "tensorflow" else two_runs(sys.argv[2])))
