"""A user's own Keras 3 `fit` under Ray Train: `python ray_user.py OUT STORAGE`.

The loop is what a user writes: `distrib_tf.make_strategy()`, a model under its scope,
`fit` with `ReportToRay`. Each rank saves its weights and what it saw of Keras to OUT.
"""

import json
import os
import sys

import ray

from distrib_tf.deploy import ray_train


def loop(config):
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import distrib_tf  # pylint: disable=import-outside-toplevel
    from distrib_tf.keras.callbacks import ReportToRay  # pylint: disable=import-outside-toplevel

    rank = ray.train.get_context().get_world_rank()
    strategy = distrib_tf.make_strategy()
    seen = {"legacy_keras_env": os.environ.get("TF_USE_LEGACY_KERAS"),
            "tf_keras_is_keras_3": tf.keras.Model is keras.Model,
            "replicas": strategy.num_replicas_in_sync}
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(dataset, epochs=2, verbose=0, callbacks=[ReportToRay(checkpoint_every=1)])
    out = config["out"]
    np.savez(os.path.join(out, f"rank{rank}.npz"), *[np.asarray(w) for w in model.get_weights()])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def main():
    out, storage = sys.argv[1:3]
    os.makedirs(out, exist_ok=True)
    ray.init()
    result = ray_train.trainer(loop, num_workers=2, config={"out": out}, storage_path=storage,
                               name="user", max_failures=0).fit()
    history = [metrics for _, metrics in result.best_checkpoints]
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"history": history, "checkpoint_files": sorted(os.listdir(result.checkpoint.path))}, f)
    print("USER RUN OK", flush=True)


if __name__ == "__main__":
    main()
