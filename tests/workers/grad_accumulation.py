"""`gradient_accumulation_steps=4` in one process: plain Keras on one device, plain Keras
under MirroredStrategy without compat fix 13 (its upstream error), and `distrib_tf.Run` on
2 logical CPU replicas for one epoch; with `--epochs=2` in a second process, the same Run
resumes that epoch's backup. Prints `RESULT {...}`.

    python tests/workers/grad_accumulation.py MODEL_DIR [--epochs=2]
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import distrib_tf
from distrib_tf.keras import backup
from distrib_tf.keras import compat

K, BATCH, ROWS = 4, 8, 48  # 6 steps an epoch: the first epoch ends inside an accumulation.


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu", name="hidden"),
                              keras.layers.Dense(1, name="out")], name="accumulating")  # One name in both processes.
    model.compile(loss="mse", optimizer=keras.optimizers.AdamW(
        0.1, weight_decay=0.01, global_clipnorm=1.0, gradient_accumulation_steps=K))
    return model


def fitted(model, history):
    return {"iterations": int(model.optimizer.iterations.numpy()), "history": history.history,
            "weights": np.concatenate([w.ravel() for w in model.get_weights()]).tolist()}


def main(model_dir, epochs):
    cpu = tf.config.list_physical_devices("CPU")[0]  # As cpu_replicas=2 splits it, before the runtime starts.
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    keras.config.set_floatx("float64")
    x = np.random.RandomState(0).rand(ROWS, 3)
    y = x.sum(1, keepdims=True)
    result = {}
    if epochs == 1:
        result.update(plain_keras(x, y))
    run = distrib_tf.Run(model_dir, strategy="mirrored", cpu_replicas=2, seed=0, backup_every_steps=4,
                         backup_in_background=False, exit_on_error=False)
    with run.strategy.scope():
        model = build()
    seen = []  # The backups on the disk at each epoch's end (before the run's own epoch-end backup).
    look = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append([b["step"] for b in backup.list_backups(run.backup_dir)]))
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[look])
    result["run"] = {**fitted(model, history), "backups_at_epoch_ends": seen,
                     "resumed_at_step": run.summary["resumed_at_step"], "step": run.step}
    run.end()
    print("RESULT " + json.dumps(result), flush=True)


def plain_keras(x, y):
    """Plain Keras on one device (no fix installed yet), then under MirroredStrategy without fix 13."""
    result = {}
    model = build()  # Plain Keras, one device: no strategy, no fix installed yet.
    result["plain"] = fitted(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0))
    strategy = distrib_tf.make_strategy(cpu_replicas=2)  # Installs the fixes.
    with strategy.scope():
        model = build()
    try:
        with compat.reverted("accumulate_reduced"):
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        result["without_fix"] = "trained"
    except RuntimeError as e:
        result["without_fix"] = str(e)
    return result


if __name__ == "__main__":
    main(sys.argv[1], 2 if "--epochs=2" in sys.argv else 1)
