"""A Keras user's own script on the run API, with a SIGTERM at one moment of its ending.

    TF_CONFIG=... python tests/workers/ending_cases.py CASE --model_dir=DIR [--no_with]

CASE, where `--sigterm_task` (the chief by default) sends itself SIGTERM, as a scheduler
would:

- `on_train_end`: in its own `on_train_end` callback, 1 s into it (as when the chief's last
  checkpoint is being written there);
- `last_step`: after the last training step;
- `after_fit`: in the script's own code after `fit`, inside a final `evaluate`;
- `none`: no SIGTERM (a restart of a preempted run).

Whatever the case, the chief's `on_train_end` writes `shared/last.keras` slowly (2 s), as
a `ModelCheckpoint` of a large model does, and after `fit` every worker loads it with plain
Keras: the lines after `fit` see every file the chief's callbacks wrote in it. Each worker
prints `TASK after fit`, `TASK loaded ...` and `TASK after the run` as it passes them.
`--no_load` leaves the load out; `--no_with` makes the run at the top of the script, without `with`.
"""

import argparse
import os
import signal
import time

import keras
import numpy as np

import distrib_tf

STEPS, EPOCHS, BATCH = 4, 2, 16


class ChiefWritesSlowly(keras.callbacks.Callback):
    """The chief writes the model at the end of `fit`, slowly (a large model's file)."""

    def __init__(self, path, is_chief):
        super().__init__()
        self.path, self.is_chief = path, is_chief

    def on_train_end(self, logs=None):
        if self.is_chief:
            time.sleep(2)
            self.model.save(self.path)


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM at `moment` (`on_train_end`, `last_step`, `evaluate`)."""

    def __init__(self, moment):
        super().__init__()
        self.moment = moment

    def on_train_batch_end(self, batch, logs=None):
        if self.moment == "last_step" and int(self.model.optimizer.iterations.numpy()) == STEPS * EPOCHS:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, logs=None):
        if self.moment == "on_train_end":
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_test_batch_end(self, batch, logs=None):
        if self.moment == "evaluate":
            os.kill(os.getpid(), signal.SIGTERM)


def script(run, args):
    """What the user writes inside the run."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    shared = os.path.join(args.model_dir, "shared")
    os.makedirs(shared, exist_ok=True)
    mine = run.task == args.sigterm_task
    callbacks = [ChiefWritesSlowly(os.path.join(shared, "last.keras"), run.is_chief)]
    if mine and args.case in ("on_train_end", "last_step"):
        callbacks.append(SigtermAt(args.case))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    print(f"{run.task} after fit", flush=True)
    if not args.no_load:
        loaded = keras.models.load_model(os.path.join(shared, "last.keras"))
        print(f"{run.task} loaded {len(loaded.get_weights())} arrays", flush=True)
    faults = [SigtermAt("evaluate")] if mine and args.case == "after_fit" else []
    model.evaluate(x, y, batch_size=BATCH, callbacks=faults, verbose=0)
    print(f"{run.task} evaluated", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["on_train_end", "last_step", "after_fit", "none"])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--sigterm_task", default="worker:0")
    parser.add_argument("--no_with", action="store_true")
    parser.add_argument("--no_load", action="store_true", help="no load of the chief's file after fit")
    args = parser.parse_args()
    if args.no_with:
        run = distrib_tf.Run(args.model_dir, seed=0)
        script(run, args)
        print(f"{run.task} after the run", flush=True)
        return
    with distrib_tf.Run(args.model_dir, seed=0) as run:
        script(run, args)
    print(f"{run.task} after the run", flush=True)


if __name__ == "__main__":
    main()
