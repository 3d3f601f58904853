"""keras.io's input pipeline under a live `distrib_tf.Run`: a seeded shuffle reshuffled every
epoch, a batch, an augmentation `map` (stateless random ops, in parallel), `cache()` and
`prefetch`, in keras.io's transfer-learning order.

    python tests/workers/keras_io_data.py MODEL_DIR [--sigterm_at_step=N] [--cpu_replicas=R] [--images]

`--images`: the rows as a folder of PNG files (two class folders, written beside MODEL_DIR once),
read by `keras.utils.image_dataset_from_directory` with a seed (its own reshuffle each epoch).

Two replicas a process by default (`cpu_replicas=2`; through the launcher, one a worker),
float64. A SIGTERM comes from a callback after step N, as a scheduler's would. Prints
`RESULT {...}`: the final weights' sha256 and the History.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile

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


def write_images(folder, x, y):
    """Each row as a 4x2 grayscale PNG in `folder/<class>/`, once (a restart finds them)."""
    if not os.path.isdir(folder):
        # A directory of this process's own: the workers may share a PID (each in a PID namespace of its own).
        scratch = tempfile.mkdtemp(prefix=f"{os.path.basename(folder)}.", dir=os.path.dirname(folder))
        pixels = np.clip((x - x.min()) / (x.max() - x.min()) * 255, 0, 255).astype(np.uint8).reshape(-1, 4, 2, 1)
        for i, (image, label) in enumerate(zip(pixels, y)):
            os.makedirs(os.path.join(scratch, "ab"[label]), exist_ok=True)
            tf.io.write_file(os.path.join(scratch, "ab"[label], f"{i:04d}.png"), tf.io.encode_png(image))
        try:
            os.rename(scratch, folder)  # Whole or not at all; another worker's may be there first.
        except OSError:
            shutil.rmtree(scratch)
    return folder


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--sigterm_at_step", type=int, default=-1)
    parser.add_argument("--cpu_replicas", type=int, default=2)
    parser.add_argument("--images", action="store_true")
    args = parser.parse_args()
    distrib_tf.Run(args.model_dir, cpu_replicas=args.cpu_replicas, backup_every_steps=1000)
    keras.config.set_floatx("float64")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8))
    y = (x[:, :4].sum(axis=1) > 0).astype("int64")
    if args.images:
        folder = write_images(os.path.join(os.path.dirname(os.path.abspath(args.model_dir)), "images"), x, y)
        rows = keras.utils.image_dataset_from_directory(folder, image_size=(4, 2), color_mode="grayscale",
                                                        batch_size=BATCH, seed=1337)
        rows = rows.map(lambda images, labels: (tf.reshape(tf.cast(images, tf.float64) / 255, [-1, 8]), labels))
    else:
        rows = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=1337).batch(BATCH)
    train = rows.map(augment, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE).cache()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=EPOCHS, verbose=0, callbacks=[Fault(args.sigterm_at_step)])
    weights = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in model.weights)).hexdigest()
    print("RESULT " + json.dumps({"weights": weights, "loss": history.history["loss"]}), flush=True)


if __name__ == "__main__":
    main()
