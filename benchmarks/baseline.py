"""P1's baseline: the main job's training written by hand with `tf.distribute`.

    baseline.py MODEL EPOCHS STEPS_PER_EPOCH GLOBAL_BATCH OUT.json

What a user would write without distrib_tf's job: `MultiWorkerMirroredStrategy` from a
hand-set TF_CONFIG, and `fit` with no callback but the timer. It reads the same data the
same way as `distrib_tf.train` (`distrib_tf.data.make_dataset_fn` through
`distribute_datasets_from_function`), builds the same model and compiles it with the same
optimizer and loss; Keras 3's `fit` under several workers needs distrib_tf's Keras fixes,
applied on both sides. Left out, and so counted as distrib_tf's cost: validation, backups,
checkpoints, TensorBoard, the NaN checks, the summary.

The chief writes `{"epoch_step_seconds": [...], "epoch_end_unix_times": [...],
"first_step_unix_time": ...}`, measured by the same timer as the main job's.
"""

import json
import sys

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

from distrib_tf import data  # noqa: E402
from distrib_tf.keras import compat  # noqa: E402
from distrib_tf.keras.callbacks import EpochTimer  # noqa: E402
from distrib_tf.models import build_model  # noqa: E402


def main():
    model_name, epochs, steps, global_batch, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    compat.apply()
    keras.utils.set_random_seed(0)
    info = data.load_info("shapes" if model_name == "cnn" else "tokens")
    dataset = strategy.distribute_datasets_from_function(
        data.make_dataset_fn(info, "train", global_batch_size=global_batch, seed=0))
    with strategy.scope():
        if model_name == "cnn":
            model = build_model("cnn", input_shape=info.input_shape, num_classes=info.num_classes)
        else:
            model = build_model("transformer", vocab_size=info.vocab_size, seq_len=info.input_shape[0],
                                num_classes=info.num_classes)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    timer = EpochTimer(global_batch)
    model.fit(dataset, epochs=epochs, steps_per_epoch=steps, callbacks=[timer], verbose=0, shuffle=False)
    if strategy.extended.should_checkpoint:
        with open(out, "w") as f:
            json.dump({"epoch_step_seconds": timer.seconds, "epoch_end_unix_times": timer.ended_at,
                       "first_step_unix_time": timer.first_step_at}, f)


if __name__ == "__main__":
    main()
