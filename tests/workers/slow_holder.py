"""A grow onto an empty disk under a collective timeout, with a holder slow to load its backup.

    TF_CONFIG=... python tests/workers/slow_holder.py BASE_DIR EPOCHS [--load_seconds=S]

Each worker's `model_dir` is `BASE_DIR/<task>`: a disk of its own. `--load_seconds`: worker:0's
`load_weights` takes S seconds more (a large model), longer than the 3 s collective timeout
of the run. Prints `worker:N final weights sha256 ...`.
"""

import argparse
import time

import keras
import numpy as np

import distrib_tf
from distrib_tf.run import export

parser = argparse.ArgumentParser()
parser.add_argument("base_dir")
parser.add_argument("epochs", type=int)
parser.add_argument("--load_seconds", type=float, default=0)
args = parser.parse_args()

if args.load_seconds:
    load_weights = keras.Model.load_weights

    def slow_load_weights(self, *a, **k):
        time.sleep(args.load_seconds)
        return load_weights(self, *a, **k)

name = str(distrib_tf.cluster.load_tf_config()[1]).replace(":", "-")  # Before the run: its own disk.
if args.load_seconds and name == "worker-0":
    keras.Model.load_weights = slow_load_weights
with distrib_tf.Run(f"{args.base_dir}/{name}", run_id="slow-holder", collective_timeout=3) as run:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = x[:, :2].sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=32, epochs=args.epochs, verbose=0)
    print(f"{run.task} final weights sha256 {export.weights_fingerprint(model)}", flush=True)
