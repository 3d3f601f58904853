"""The baseline: a hand-written MultiWorkerMirroredStrategy Keras job, no distrib_tf.

TF_CONFIG is set by hand; the two Keras 3 fixes that `fit` needs under several workers
are inlined. Same model, data and global batch as `distrib_tf.train --model=cnn`.
Writes `{"examples_per_second": ..., "first_step_unix_time": ...}` from the chief.
"""

import json
import sys
import time

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
from keras.src.backend.tensorflow import trainer  # noqa: E402

from distrib_tf.data import _make_shapes  # noqa: E402  The same numpy data.
from distrib_tf.models import build_cnn  # noqa: E402  The same model.

_original_reduce = trainer.reduce_per_replica


def _reduce(values, strategy_, reduction):  # Keras 3 reduces scalar logs with axis=0.
    if reduction in ("auto", "mean") and isinstance(strategy_, tf.distribute.MultiWorkerMirroredStrategy):
        return tf.nest.map_structure(lambda v: strategy_.reduce("MEAN", v, axis=None), values)
    return _original_reduce(values, strategy_, reduction)


def _symbolic_build(self, iterator=None, data_batch=None):  # Keras 3 reduces the data batch.
    local = self.distribute_strategy.experimental_local_results
    for _, _, it in iterator:
        data_batch = tf.nest.map_structure(lambda x: local(x)[0], next(it))
        break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


trainer.reduce_per_replica = _reduce
trainer.TensorFlowTrainer._maybe_symbolic_build = _symbolic_build


def main():
    epochs, steps, global_batch, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    x, y = _make_shapes("train")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).cache().shuffle(4096).repeat()
    dataset = dataset.batch(global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        model = build_cnn(input_shape=(28, 28, 1), num_classes=10)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    seconds, first = [], []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = self.last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()
            if not first:
                first.append(time.time())

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(self.last - self.start)  # Training steps only, as distrib_tf's timer.

    model.fit(dataset, epochs=epochs, steps_per_epoch=steps, callbacks=[Timer()], verbose=0)
    steady = seconds[1:] or seconds
    if strategy.extended.should_checkpoint:
        with open(out, "w") as f:
            json.dump({"examples_per_second": steps * global_batch * len(steady) / sum(steady),
                       "first_step_unix_time": first[0]}, f)


if __name__ == "__main__":
    main()
