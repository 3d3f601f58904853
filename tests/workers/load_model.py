"""Loads what the main job exported, in a process of its own, and says what it found.

    load_model.py MODEL_DIR

Prints one JSON line: the weights fingerprint of `model.keras` (as the job computes it),
the accuracy on the test split through Keras and through `serving/`
(`tf.saved_model.load`, no Keras), and their largest output difference.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

from distrib_tf import data
from distrib_tf.train import serving

model_dir = sys.argv[1]
with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
source = data.load_source(data.load_info(summary["config"]["dataset"]), "test").batch(100_000)
x, y = (t.numpy() for t in next(iter(source)))
model = serving.load_model(os.path.join(model_dir, "model.keras"))
served = tf.saved_model.load(os.path.join(model_dir, "serving"))
through_keras = model.predict(x, verbose=0)
through_serving = np.concatenate([served.serve(x[i:i + 256]).numpy() for i in range(0, len(x), 256)])
print(json.dumps({
    "weights_sha256": serving.weights_fingerprint(model),
    "keras_accuracy": float(np.mean(np.argmax(through_keras, -1) == y)),
    "serving_accuracy": float(np.mean(np.argmax(through_serving, -1) == y)),
    "max_difference": float(np.max(np.abs(through_keras - through_serving))),
}))
