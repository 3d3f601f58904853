"""The main job's model and per-step callbacks on this worker; then the ops of its training step.

Trains the main job's compiled model (`distrib_tf.train.job.build_compiled_model`) for a few
steps with the callbacks the main job adds to every step (`Progress`, `StopOnNonFinite`),
then writes `OUT/<task>.json`: how many ops of each kind the traced training step holds,
counted in its graph and every function it calls.
"""

import collections
import json
import sys

import numpy as np
import tensorflow as tf

import distrib_tf
from distrib_tf import data
from distrib_tf.keras import nonfinite
from distrib_tf.keras import progress
from distrib_tf.keras import step_logs
from distrib_tf.train.config import TrainConfig
from distrib_tf.train.job import build_compiled_model

STEPS, GLOBAL_BATCH = 3, 8


def traced_functions(function, seen=None):
    """The `tf.function`s inside `function`: Keras keeps its step in closures and wrappers."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return []
    seen.add(id(function))
    if hasattr(function, "_list_all_concrete_functions"):
        return [function]
    found = []
    inner = [getattr(function, "__wrapped__", None)]
    inner += [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]
    for each in inner:
        if callable(each):
            found += traced_functions(each, seen)
    return found


def op_counts(function) -> collections.Counter:
    """Op types in every traced step inside `function`, and in the functions they call."""
    counts = collections.Counter()
    concretes = [c for f in traced_functions(function) for c in f._list_all_concrete_functions()]  # pylint: disable=protected-access
    assert concretes, "no traced step found in the train function"
    functions = {}  # Each function once, by name: a step's graph lists the functions it calls.
    for concrete in concretes:
        graph = concrete.graph.as_graph_def()
        name = concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name
        functions[name] = [node.op for node in graph.node]
        for library_function in graph.library.function:
            functions[library_function.signature.name] = [node.op for node in library_function.node_def]
    for ops in functions.values():
        counts.update(ops)
    return counts


def main():
    model_name, out = sys.argv[1], sys.argv[2]
    strategy = distrib_tf.make_strategy()
    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type}:{resolver.task_id}"
    workers = [f"worker:{i}" for i in range(strategy.num_replicas_in_sync)]
    config = TrainConfig(model=model_name)
    info = data.load_info(config.dataset)
    model = build_compiled_model(config, info, strategy)
    step_logs.carry(model)  # As distrib_tf.Run.fit does under sync="step" on several workers.
    x, y = next(iter(data.load_source(info, "train").batch(GLOBAL_BATCH).take(1)))
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[
        progress.Progress(task=task, workers=workers, epochs=1, steps_per_epoch=STEPS,
                          global_batch_size=GLOBAL_BATCH, window=2),
        nonfinite.StopOnNonFinite(workers=workers, steps_per_epoch=STEPS)])
    counts = op_counts(model.train_function)
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    with open(f"{out}/{task.replace(':', '_')}.json", "w", encoding="utf-8") as f:
        json.dump({"ops": dict(counts), "weights_sum": float(weights.astype(np.float64).sum())}, f)


if __name__ == "__main__":
    main()
