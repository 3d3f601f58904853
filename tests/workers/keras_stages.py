"""A Keras user's transfer-learning script under a live `distrib_tf.Run`, unchanged Keras
calls: fit the head on a `tf.data.Dataset`, unfreeze, recompile, fine-tune on arrays.

    python tests/workers/keras_stages.py MODEL_DIR [--sigterm_at_step=N --sigterm_stage=I]
    python tests/workers/keras_stages.py MODEL_DIR --early_stopping [--sigterm_at_step=N]
    python tests/workers/keras_stages.py MODEL_DIR --train_more [--sigterm_at_step=N --sigterm_stage=I]

One process, two replicas (`cpu_replicas=2`; one with `--train_more`), a `Dropout` in the model. A fault acts from
outside the script's Keras code: a callback in the list, as a scheduler's SIGTERM after a
step would. Prints `RESULT {...}`: the final weights' sha256, each stage's History, and
the epochs the early-stopping stage trained in this process.
"""

import argparse
import hashlib
import json

import keras
import numpy as np
import tensorflow as tf
from faults import Fault  # pylint: disable=wrong-import-order  (beside this script)

import distrib_tf

ROWS, BATCH = 256, 32  # 8 steps an epoch.


class Epochs(keras.callbacks.Callback):
    """The epochs this process trained (the user's own callback)."""

    def __init__(self):
        super().__init__()
        self.trained, self.began = [], 0

    def on_train_begin(self, logs=None):
        self.began += 1

    def on_epoch_end(self, epoch, logs=None):
        self.trained.append(epoch + 1)


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int64")
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--sigterm_at_step", type=int, default=-1)
    parser.add_argument("--sigterm_stage", type=int, default=0)
    parser.add_argument("--early_stopping", action="store_true")
    parser.add_argument("--train_more", action="store_true",
                        help="Keras's 'train more': a second fit of the same compiled model, 3 steps an execution")
    args = parser.parse_args()
    faults = [[], []]
    if args.sigterm_at_step > 0:
        faults[args.sigterm_stage].append(Fault(args.sigterm_at_step))

    # Keras 3 runs several steps an execution on one replica only (`distrib_tf.keras.compat`).
    run = distrib_tf.Run(args.model_dir, seed=0, backup_every_steps=3, cpu_replicas=1 if args.train_more else 2)
    x, y = data()
    base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu")], name="base")
    model = keras.Sequential([base, keras.layers.Dropout(0.3), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    epochs = Epochs()
    results = {}
    if args.early_stopping:  # Never better by 1e9: patience 2 stops it after epoch 3 of 6, on epoch 1's weights.
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
        stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=1e9, restore_best_weights=True)
        history = model.fit(x, y, batch_size=BATCH, epochs=6, callbacks=[stop, epochs, *faults[0]], verbose=0)
        results["histories"] = [history.history]
    elif args.train_more:  # 8 steps an epoch, executions of 3, 3 and 2; the second fit from iteration 16.
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"], steps_per_execution=3)
        first = model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[epochs, *faults[0]], verbose=0)
        more = model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=faults[1], verbose=0)
        results["histories"] = [first.history, more.history]
        results["iterations"] = int(model.optimizer.iterations.numpy())
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=1).batch(BATCH)
        base.trainable = False
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
        head = model.fit(dataset, epochs=2, callbacks=[epochs, *faults[0]], verbose=0)
        base.trainable = True
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss, metrics=["accuracy"])
        tuned = model.fit(x, y, batch_size=BATCH, epochs=3, validation_split=0.25, callbacks=faults[1], verbose=0)
        results["histories"] = [head.history, tuned.history]
        results["evaluate"] = model.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    results.update(weights=digest, epochs_trained=epochs.trained, train_begins=epochs.began, task=run.task)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
