"""A Keras user's model with a large embedding: are its gradients still sparse?

Trains an `Embedding(VOCAB, DIM)` model for a few steps under `distrib_tf.make_strategy()`
(one process, or several workers with TF_CONFIG) and writes OUT/<task>.json:
`sparse_updates` (the optimizer updated a variable with a `tf.IndexedSlices`, the check of
Keras's own `test_fit_sparse`), `allreduce_bytes` (what each replica handed to the gradient
all-reduce per step: values and indices) and `table_bytes`; and OUT/<task>.npz, the weights.

    python tests/workers/sparse_grads.py OUT [--optimizer=sgd|adagrad|adam] [--without_fix=FIX]
        [--float64] [--dense]
"""

import argparse
import json
import os

import numpy as np

import distrib_tf

VOCAB, DIM, SEQ, GLOBAL_BATCH, STEPS = 250_000, 16, 32, 16, 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--without_fix", default="")
    parser.add_argument("--cpu_replicas", type=int, default=None, help="MirroredStrategy over logical CPUs")
    parser.add_argument("--float64", action="store_true", help="so that only a different sum shows")
    parser.add_argument("--dense", action="store_true",
                        help="densify every gradient first: the dense definition, for reference")
    args = parser.parse_args()
    strategy = distrib_tf.make_strategy(cpu_replicas=args.cpu_replicas)
    if args.without_fix:
        from distrib_tf.keras import compat  # pylint: disable=import-outside-toplevel
        compat.revert(args.without_fix)
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from keras.src.backend.tensorflow import optimizer as tf_optimizer  # pylint: disable=import-outside-toplevel

    resolver = getattr(strategy, "cluster_resolver", None)
    task = (f"{resolver.task_type}_{resolver.task_id}" if resolver and resolver.task_type
            else f"replicas_{args.cpu_replicas}" if args.cpu_replicas else "single")
    if args.float64:
        keras.backend.set_floatx("float64")
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(0)
    # Few distinct tokens: every batch repeats some, within a replica and across replicas.
    x = rng.integers(0, 40, size=(STEPS * GLOBAL_BATCH, SEQ)).astype("int32")
    y = rng.normal(size=(STEPS * GLOBAL_BATCH, 1)).astype(keras.backend.floatx())
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)

    handed = tf.Variable(0, dtype=tf.int64, trainable=False)  # Bytes to the all-reduce, this replica.
    all_reduce = tf_optimizer.TFOptimizer._all_reduce_sum_gradients  # pylint: disable=protected-access

    def measured_all_reduce(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        sizes = []
        for g, _ in grads_and_vars:
            for part in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,)):
                sizes.append(tf.cast(tf.size(part), tf.int64) * part.dtype.size)
        handed.assign(tf.add_n(sizes))
        return all_reduce(self, grads_and_vars)

    tf_optimizer.TFOptimizer._all_reduce_sum_gradients = measured_all_reduce  # pylint: disable=protected-access

    with strategy.scope():
        model = keras.Sequential([keras.Input((SEQ,), dtype="int32"), keras.layers.Embedding(VOCAB, DIM),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        optimizer = {"sgd": keras.optimizers.SGD(0.1), "adagrad": keras.optimizers.Adagrad(0.1),
                     "adam": keras.optimizers.Adam(0.01)}[args.optimizer]
        model.compile(optimizer=optimizer, loss="mse")
    sparse_updates = []
    for name in ("assign", "assign_add", "assign_sub"):  # Keras's own test watches assign_sub.
        original = getattr(optimizer, name)

        def watched(variable, value, original=original):
            if isinstance(value, tf.IndexedSlices):
                sparse_updates.append(variable.name)
            return original(variable, value)

        setattr(optimizer, name, watched)
    if args.dense:
        apply = optimizer.apply
        optimizer.apply = lambda grads, variables=None: apply(
            [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads], variables)
    model.fit(strategy.experimental_distribute_dataset(dataset), epochs=1, steps_per_epoch=STEPS, verbose=0)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"{task}.npz"), *[np.asarray(w) for w in model.get_weights()])
    with open(os.path.join(args.out, f"{task}.json"), "w", encoding="utf-8") as f:
        json.dump({"sparse_updates": sorted(set(sparse_updates)), "allreduce_bytes": int(handed.numpy()),
                   "table_bytes": VOCAB * DIM * np.dtype(keras.backend.floatx()).itemsize,
                   "replicas": strategy.num_replicas_in_sync}, f)
    print(f"{task}: all-reduce {int(handed.numpy())} bytes a step; sparse updates {sorted(set(sparse_updates))}",
          flush=True)


if __name__ == "__main__":
    main()
