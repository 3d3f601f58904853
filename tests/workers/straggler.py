"""A Keras user's model with `distrib_tf.keras.progress.Progress`, one worker slowed on purpose.

Every step, `--slow_task` sleeps `--sleep` seconds on the host before its step (inside the
interval that `Progress` measures): the other workers then wait that long in the
gradient all-reduce, so their wall step time is as long but their own is not.
"""

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf

import distrib_tf
from distrib_tf.keras.progress import Progress

GLOBAL_BATCH, STEPS, EPOCHS = 16, 40, 2


class Sleep(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(self.seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow_task", default="worker:1")
    parser.add_argument("--sleep", type=float, default=0.08)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distrib_tf.log_to_stderr()
    strategy = distrib_tf.make_strategy()
    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type}:{resolver.task_id}"
    workers = [f"worker:{i}" for i in range(strategy.num_replicas_in_sync)]
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)), rng.normal(size=(GLOBAL_BATCH * STEPS, 1))
    progress = Progress(task=task, workers=workers, epochs=EPOCHS, steps_per_epoch=STEPS,
                        global_batch_size=GLOBAL_BATCH, window=5, patience=3)
    slow = [Sleep(args.sleep)] if task == args.slow_task else []
    # Endless, like the main job's: a multi-worker strategy then synchronizes the workers
    # in the gradient all-reduce only, not also before each step to ask who has data.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False,
                        callbacks=[progress, *slow], verbose=0)
    with open(f"{args.out}/{task.replace(':', '_')}.json", "w", encoding="utf-8") as f:
        json.dump({"latest": progress.latest, "history": {k: [float(v) for v in vs]
                                                          for k, vs in history.history.items()}}, f)


if __name__ == "__main__":
    main()
