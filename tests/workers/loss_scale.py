"""A Keras user's mixed_float16 `fit` on several workers, an overflow on worker:1 alone.

Each worker's input pipeline makes its own batches; worker:1's batch of step OVERFLOW_STEP
holds a value float16 cannot represent, so only its gradients are non-finite there. Keras's
LossScaleOptimizer should skip that step everywhere and halve its loss scale. Writes
`<task>.json` (iterations, loss scale, steps run) and `<task>.npz` (weights) into OUT.

    python tests/workers/loss_scale.py OUT [--without_fix=loss_scale] [--collective_timeout=S]
"""

import argparse
import json
import os

import numpy as np

import distrib_tf

STEPS, OVERFLOW_STEP, PER_REPLICA = 6, 3, 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--without_fix", default="")
    parser.add_argument("--collective_timeout", type=float, default=None)
    args = parser.parse_args()
    strategy = distrib_tf.make_strategy(collective_timeout=args.collective_timeout)
    if args.without_fix:
        from distrib_tf.keras import compat  # pylint: disable=import-outside-toplevel
        compat.revert(args.without_fix)
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type}_{resolver.task_id}"
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(3)

    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        x = rng.normal(size=(STEPS, PER_REPLICA, 4)).astype("float32")
        if context.input_pipeline_id == 1:
            x[OVERFLOW_STEP - 1, 0, 0] = 1e30  # Inf once cast to float16: worker:1's gradients only.
        y = rng.normal(size=(STEPS, PER_REPLICA, 1)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat()

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer), type(model.optimizer)
    start_scale = float(model.optimizer.initial_scale)
    history = model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1,
                        steps_per_epoch=STEPS, verbose=0)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"{task}.npz"), *[np.asarray(w) for w in model.get_weights()])
    with open(os.path.join(args.out, f"{task}.json"), "w", encoding="utf-8") as f:
        json.dump({"iterations": int(model.optimizer.iterations.numpy()), "steps": STEPS,
                   "start_scale": start_scale, "scale": float(model.optimizer.dynamic_scale.numpy()),
                   "loss": history.history["loss"]}, f)
    print(f"{task} trained: iterations {int(model.optimizer.iterations.numpy())}", flush=True)


if __name__ == "__main__":
    main()
