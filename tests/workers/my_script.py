"""A Keras user's own training script on the run API (`distrib_tf.Run`), with faults to order.

    python tests/workers/my_script.py --model_dir=DIR [--epochs=3] [--sigterm_at_step=N]
        [--kill_at_step=N --kill_marker=FILE] [--inf_at_step=N] [--flaky] [--on_nan=stop] [--sync=every:N]

The script is what a user writes (the `with distrib_tf.Run(...)` block); the fault options
act from outside the library: a SIGTERM or SIGKILL the process sends itself after a step
(as a scheduler would), and an Inf in one example of worker:1's batch at a step (`--flaky`:
only the first time it is read, as a bad read from a disk). Every worker prints its final
weights' sha256 and writes `OUT/<task>.json` (what its own callback saw).
"""

import argparse
import json
import os
import signal
import sys

import keras
import numpy as np

import distrib_tf
from distrib_tf.data import order

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import my_models  # noqa: E402  pylint: disable=wrong-import-position

GLOBAL_BATCH = 32
STEPS = my_models.ROWS // GLOBAL_BATCH


class Seen(keras.callbacks.Callback):
    """The user's own callback: the steps and epochs it saw, and the learning rate."""

    def __init__(self):
        super().__init__()
        self.steps, self.epochs = 0, []

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch + 1)


class Fault(keras.callbacks.Callback):
    """Sends this process `signum` once global step `step` is done."""

    def __init__(self, step, signum, marker=None):
        super().__init__()
        self.step, self.signum, self.marker = step, signum, marker

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            if self.marker:
                if os.path.exists(self.marker):
                    return
                open(self.marker, "w").close()
            os.kill(os.getpid(), self.signum)


class FlakySource:
    """The training arrays as a random-access source; one example reads Inf the first time."""

    def __init__(self, x, y, bad_id):
        self.x, self.y, self.bad_id, self.read_bad = x, y, bad_id, False

    def __len__(self):
        return len(self.y["value"])

    def __getitem__(self, i):
        features = {k: v[i] for k, v in self.x.items()}
        if i == self.bad_id and not self.read_bad:
            self.read_bad = True
            features["features"] = np.full_like(features["features"], np.inf)
        return features, {k: v[i] for k, v in self.y.items()}


def worker1_example(step):
    """The id of the first example of worker:1's slice (replica 1 of 2) in global step `step` (1-based)."""
    epoch, position = divmod(step - 1, STEPS)
    ids = order.example_ids([position * GLOBAL_BATCH + GLOBAL_BATCH // 2], epoch, num_examples=my_models.ROWS,
                            seed=0, shuffle=True)
    return int(ids.numpy()[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sigterm_at_step", type=int, default=-1)
    parser.add_argument("--sigterm_task", default="worker:1")
    parser.add_argument("--kill_at_step", type=int, default=-1)
    parser.add_argument("--kill_marker", default=None)
    parser.add_argument("--inf_at_step", type=int, default=-1)
    parser.add_argument("--flaky", action="store_true")
    parser.add_argument("--on_nan", default="stop")
    parser.add_argument("--global_batch_size", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--sync", default="step")
    args = parser.parse_args()
    batch = args.global_batch_size

    with distrib_tf.Run(args.model_dir, seed=0, backup_every_steps=5, on_nan=args.on_nan, sync=args.sync) as run:
        keras.config.set_dtype_policy("float64")
        with run.strategy.scope():
            model = my_models.build(total_steps=args.epochs * -(-my_models.ROWS // batch))  # Keras's steps: every row.
        x, y = my_models.arrays()
        if args.inf_at_step > 0 and not args.flaky:
            x["features"][worker1_example(args.inf_at_step)] = np.inf
        bad_id = worker1_example(args.inf_at_step) if run.task == "worker:1" else -1  # Its own read only.
        train = (distrib_tf.data.from_source(FlakySource(x, y, bad_id))
                 if args.flaky else distrib_tf.data.from_arrays(x, y))
        validation = distrib_tf.data.from_arrays(*my_models.arrays(128, seed=1))
        seen, faults = Seen(), []
        if args.sigterm_at_step > 0 and run.task == args.sigterm_task:
            faults.append(Fault(args.sigterm_at_step, signal.SIGTERM))
        if args.kill_at_step > 0 and run.task == "worker:1":
            faults.append(Fault(args.kill_at_step, signal.SIGKILL, args.kill_marker))
        history = run.fit(model, train, epochs=args.epochs, global_batch_size=batch,
                          validation_data=validation, callbacks=[seen, *faults])
        evaluated = model.evaluate(run.distribute(validation, global_batch_size=batch),
                                   steps=validation.steps_per_epoch(batch), return_dict=True, verbose=0)
        run.save(model)
        weights = run.summary["weights_sha256"]
        print(f"{run.task} final weights sha256 {weights}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{run.task.replace(':', '_')}.json"), "w", encoding="utf-8") as f:
                json.dump({"weights": weights, "steps_seen": seen.steps, "epochs_seen": seen.epochs,
                           "history_epochs": history.epoch, "loss": history.history["loss"],
                           "evaluate": {k: float(v) for k, v in evaluated.items()},
                           "resumed_at_step": run.summary["resumed_at_step"],
                           "rollbacks": run.summary["rollbacks"]}, f)
    print(f"{run.task} after the run", flush=True)  # Leaving the block returns, on every layout.


if __name__ == "__main__":
    main()
