"""A Keras user's own script: its own model under `distrib_tf.make_strategy()`.

Run as one process or as several workers with TF_CONFIG; each process writes what it
saw into `--out` (weights, losses, evaluate, predict) for the tests to compare.
"""

import argparse
import json
import os
import signal

import numpy as np

import distrib_tf

GLOBAL_BATCH = 16
ROWS = 128


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill_self_at_epoch", type=int, default=-1)
    parser.add_argument("--kill_task", default="worker:1")
    parser.add_argument("--without_fix", default="", help="a distrib_tf Keras fix to remove")
    return parser.parse_args()


def make_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(ROWS, 1))).astype("float32")
    return x, y


def main():
    args = parse_args()
    strategy = distrib_tf.make_strategy()
    if args.without_fix:
        from distrib_tf import _keras_compat  # pylint: disable=import-outside-toplevel
        _keras_compat.revert(args.without_fix)
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    resolver = getattr(strategy, "cluster_resolver", None)
    task = f"{resolver.task_type}:{resolver.task_id}" if resolver and resolver.task_type else "single"
    os.makedirs(args.out, exist_ok=True)

    keras.utils.set_random_seed(1)
    x, y = make_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])

    epochs_run, saved = [], []
    save_weights = model.save_weights

    def recording_save_weights(filepath, *a, **k):  # Real saves, with a record of who.
        saved.append(os.path.relpath(filepath, args.out))
        return save_weights(filepath, *a, **k)

    model.save_weights = recording_save_weights

    class RecordEpochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)
            if epoch == args.kill_self_at_epoch and task == args.kill_task:
                os.kill(os.getpid(), signal.SIGKILL)

    shared = os.path.join(args.out, "shared")
    callbacks = [
        RecordEpochs(),
        keras.callbacks.BackupAndRestore(os.path.join(shared, "backup"), delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(os.path.join(shared, "checkpoints", "epoch{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.TensorBoard(os.path.join(shared, "logs")),
    ]
    history = model.fit(dataset, epochs=args.epochs, callbacks=callbacks, verbose=0)
    evaluation = model.evaluate(dataset, return_dict=True, verbose=0)
    predictions = model.predict(tf.data.Dataset.from_tensor_slices(x[:10]).batch(4), verbose=0)

    np.savez(
        os.path.join(args.out, f"{task.replace(':', '_')}.npz"),
        *[np.asarray(w) for w in model.get_weights()],
    )
    with open(os.path.join(args.out, f"{task.replace(':', '_')}.json"), "w") as f:
        json.dump({
            # This process as the host sees it: tasks may run in PID namespaces of their own,
            # where os.getpid() is the same for every task; /proc here is the host's.
            "pid": int(os.readlink("/proc/self")),
            # Where this worker's TensorBoard events went (a scratch directory off the chief).
            "tensorboard_dir": getattr(callbacks[-1], "_distrib_tf_scratch", None) or callbacks[-1].log_dir,
            "replicas": strategy.num_replicas_in_sync,
            "epochs_run": epochs_run,
            "saved": saved,
            "history": history.history,
            "evaluate": evaluation,
            "predict": np.asarray(predictions).tolist(),
        }, f)


if __name__ == "__main__":
    main()
