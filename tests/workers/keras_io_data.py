"""keras.io's input pipeline under a live `distrib_tf.Run`: a seeded shuffle reshuffled every
epoch, a batch, an augmentation `map` (stateless random ops, in parallel), `cache()` and
`prefetch`, in keras.io's transfer-learning order.

    python tests/workers/keras_io_data.py MODEL_DIR [--sigterm_at_step=N]

One process, two replicas (`cpu_replicas=2`), float64. A SIGTERM comes from a callback
after step N, as a scheduler's would. Prints `RESULT {...}`: the final weights' sha256 and
the History.
"""

import argparse
import hashlib
import json

import keras
import numpy as np
import tensorflow as tf
from faults import Fault  # pylint: disable=wrong-import-order  (beside this script)

import distrib_tf

ROWS, BATCH, EPOCHS = 512, 32, 4  # 16 steps an epoch.


def augment(x, y):
    noise = tf.random.stateless_normal(tf.shape(x), seed=tf.cast(tf.stack([x[0, 0] * 1e6, 7.0]), tf.int64),
                                       dtype=x.dtype)
    return x + 0.1 * noise, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--sigterm_at_step", type=int, default=-1)
    args = parser.parse_args()
    distrib_tf.Run(args.model_dir, cpu_replicas=2, backup_every_steps=1000)
    keras.config.set_floatx("float64")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8))
    y = (x[:, :4].sum(axis=1) > 0).astype("int64")
    train = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=1337).batch(BATCH)
             .map(augment, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE).cache())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=EPOCHS, verbose=0, callbacks=[Fault(args.sigterm_at_step)])
    weights = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in model.weights)).hexdigest()
    print("RESULT " + json.dumps({"weights": weights, "loss": history.history["loss"]}), flush=True)


if __name__ == "__main__":
    main()
