"""A Keras user's own script: its own model under `distrib_tf.make_strategy()`.

Run as one process or as several workers with TF_CONFIG; each process writes what it
saw into `--out` (weights, losses, evaluate, predict) for the tests to compare.
"""

import argparse
import contextlib
import functools
import json
import os
import signal
import threading
import time
import weakref

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
    parser.add_argument("--read_only_shared", action="store_true",
                        help="worker:1 sees `shared/` read-only, as a host whose disk the chief's "
                             "files are not on (root: a mount namespace of its own)")
    parser.add_argument("--delete_backup", action="store_true", help="BackupAndRestore(delete_checkpoint=True)")
    parser.add_argument("--collective_timeout", type=float, default=None)
    parser.add_argument("--slow_trace_seconds", type=float, default=0,
                        help="worker:1 takes this long to trace the train step, as a large "
                             "model on a loaded machine does")
    parser.add_argument("--slow_train_end_seconds", type=float, default=0,
                        help="the chief takes this long to end fit, as one writing a large "
                             "model does")
    parser.add_argument("--fit_in_scope", action="store_true", help="fit inside strategy.scope(), as many "
                        "Keras scripts do")
    parser.add_argument("--hang_seconds", type=float, default=0,
                        help="dump every thread's stack and exit after this long (a hang's evidence)")
    return parser.parse_args()


def make_shared_read_only(shared):
    """This process (and only it) sees `shared` read-only from now on."""
    import ctypes  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel

    if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    for mount in (["--make-rprivate", "/"], ["--bind", shared, shared], ["-o", "remount,bind,ro", shared]):
        subprocess.run(["mount", *mount], check=True)


def reduce_sum_across_workers(strategy, tf):
    """Keras's own `reduce_per_replica(..., "sum")` on replica ids + 1: the SUM branch."""
    from keras.src.backend.tensorflow import trainer  # pylint: disable=import-outside-toplevel

    values = strategy.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1,
                                          tf.float32))
    try:
        return float(trainer.reduce_per_replica(values, strategy, "sum"))
    except Exception as e:  # pylint: disable=broad-except
        return f"{type(e).__name__}: {e}"


def slow_to_trace(step, seconds):
    """`step`, sleeping `seconds` the first time it runs: when its function is traced."""
    traced = []

    @functools.wraps(step)
    def slow(*args, **kwargs):
        if not traced:
            traced.append(True)
            time.sleep(seconds)
        return step(*args, **kwargs)

    return slow


def make_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(ROWS, 1))).astype("float32")
    return x, y


def main():
    args = parse_args()
    if args.hang_seconds:
        import faulthandler  # pylint: disable=import-outside-toplevel
        faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    strategy = distrib_tf.make_strategy(collective_timeout=args.collective_timeout)
    if args.without_fix:
        from distrib_tf.keras import compat  # pylint: disable=import-outside-toplevel
        compat.revert(args.without_fix)
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

    if args.slow_trace_seconds and task == "worker:1":
        model.train_step = slow_to_trace(model.train_step, args.slow_trace_seconds)

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
    os.makedirs(shared, exist_ok=True)
    if args.read_only_shared and task == "worker:1":
        make_shared_read_only(shared)
    with open(os.path.join(args.out, f"{task.replace(':', '_')}_sum.json"), "w") as f:
        json.dump(reduce_sum_across_workers(strategy, tf), f)

    def marker(of_task, what):
        return os.path.join(args.out, f"{of_task.replace(':', '_')}_{what}")

    def wait_for(paths):
        deadline = time.monotonic() + 60  # A task that died before its train end.
        while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
            time.sleep(0.1)

    class ChiefDeletesLast(keras.callbacks.Callback):
        """With --delete_backup, at train end the others try to delete the backup once the
        chief has saved its last one, and the chief deletes it once they have tried."""

        def on_train_end(self, logs=None):
            if not args.delete_backup:
                return
            with open(marker(task, "train_end"), "w"):  # The chief's: its backups are saved.
                pass
            if task == "worker:0":
                workers = resolver.cluster_spec().num_tasks("worker")
                wait_for([marker(f"worker:{i}", "backup_end") for i in range(1, workers)])
            else:
                wait_for([marker("worker:0", "train_end")])

    class MarkedBackupAndRestore(keras.callbacks.BackupAndRestore):
        """Marks, outside `shared/`, that this task's train end is over, failed or not."""

        def on_train_end(self, logs=None):
            try:
                super().on_train_end(logs)
            finally:
                with open(marker(task, "backup_end"), "w"):
                    pass

    released_by = []  # The thread that let go of each validation iterator, as it happened.

    class RecordReleases(keras.callbacks.Callback):
        def on_test_end(self, logs=None):
            iterator = getattr(self.model, "_eval_epoch_iterator", None)  # Only inside fit.
            if iterator is not None and iterator._current_iterator is not None:
                weakref.finalize(iterator._current_iterator,
                                 lambda: released_by.append(threading.current_thread().name))

    class SlowTrainEnd(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            if task == "worker:0":
                time.sleep(args.slow_train_end_seconds)

    callbacks = [
        RecordEpochs(),
        SlowTrainEnd(),
        RecordReleases(),
        ChiefDeletesLast(),
        MarkedBackupAndRestore(os.path.join(shared, "backup"), delete_checkpoint=args.delete_backup),
        keras.callbacks.ModelCheckpoint(os.path.join(shared, "checkpoints", "epoch{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.TensorBoard(os.path.join(shared, "logs")),
    ]
    with strategy.scope() if args.fit_in_scope else contextlib.nullcontext():
        history = model.fit(dataset, validation_data=dataset, epochs=args.epochs, callbacks=callbacks, verbose=0)
    evaluation = model.evaluate(dataset, return_dict=True, verbose=0)
    predictions = model.predict(tf.data.Dataset.from_tensor_slices(x[:10]).batch(4), verbose=0)
    for thread in threading.enumerate():  # Iterators fit and evaluate let go of, still being released.
        if thread.name == "distrib_tf-iterator-release":
            thread.join()

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
            "validation_iterators_released_by": released_by,
            "saved": saved,
            "history": history.history,
            "evaluate": evaluation,
            "predict": np.asarray(predictions).tolist(),
        }, f)


if __name__ == "__main__":
    main()
