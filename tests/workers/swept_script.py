"""A Keras user's own script with two hyperparameters, as a sweep runs it unchanged.

    python tests/workers/swept_script.py [--epochs=3] [--second_fit=EPOCHS] [--float64] [--slow=SECONDS]

Dict inputs and a metric of the user's own (`within_half`); `distrib_tf.params` names the
swept values. Outside a sweep it trains with its defaults. Each worker writes what it
saw to `<model_dir>/seen/<task>/`: its params at the start (`params-<pid>.json`), its History
(the last fit's) and final weights at the end (`end.json`). `--second_fit=N`: a second
`fit` of N epochs after the first, as a fine-tuning script has.
"""

import argparse
import json
import os
import sys
import time

import keras
import numpy as np

import distrib_tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import my_models  # noqa: E402  pylint: disable=wrong-import-position

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--second_fit", type=int, default=0, help="epochs of a second fit (0: none)")
parser.add_argument("--float64", action="store_true")
parser.add_argument("--slow", type=float, default=0.0, help="seconds of sleep after each step")
args = parser.parse_args()
if args.float64:
    keras.config.set_floatx("float64")

hp = distrib_tf.params(learning_rate=0.05, units=8)


def within_half(y_true, y_pred):
    """The user's own metric: the share of values predicted within 0.5."""
    error = keras.ops.abs(keras.ops.cast(y_true, y_pred.dtype) - y_pred)
    return keras.ops.mean(keras.ops.cast(error < 0.5, "float32"))


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(args.slow)


with distrib_tf.Run("runs/swept", backup_every_steps=4) as run:
    seen = os.path.join(run.model_dir, "seen", run.task.replace(":", "_"))
    os.makedirs(seen, exist_ok=True)
    with open(os.path.join(seen, f"params-{os.getpid()}.json"), "w", encoding="utf-8") as f:
        json.dump(hp, f)  # Before training: a pruned trial says what it saw too.
    x, y = my_models.arrays()
    xv, yv = my_models.arrays(128, seed=1)
    features = keras.Input((my_models.FEATURES,), name="features")
    meta = keras.Input((my_models.META,), name="meta")
    hidden = keras.layers.Dense(hp["units"], activation="relu")(keras.layers.Concatenate()([features, meta]))
    value = keras.layers.Dense(1, name="value")(hidden)
    model = keras.Model({"features": features, "meta": meta}, value)
    model.compile(optimizer=keras.optimizers.SGD(hp["learning_rate"], momentum=0.9), loss="mse",
                  metrics=[within_half])
    history = model.fit(x, y["value"], batch_size=32, epochs=args.epochs, validation_data=(xv, yv["value"]),
                        callbacks=[Slow()] if args.slow else None)
    if args.second_fit:
        history = model.fit(x, y["value"], batch_size=32, epochs=args.second_fit, validation_data=(xv, yv["value"]),
                            callbacks=[Slow()] if args.slow else None)
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()]).tolist()
    with open(os.path.join(seen, "end.json"), "w", encoding="utf-8") as f:
        json.dump({"history": history.history, "weights": weights}, f)
