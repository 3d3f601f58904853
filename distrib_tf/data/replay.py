"""What a user's `tf.data.Dataset` replays alike, read from its graph without reading a batch.

A run resumes a `tf.data.Dataset` by replaying it: a fresh process makes one iterator of
`dataset.repeat()` for the stage and drops the batches before its step. That gives the
batches of the uninterrupted run when the process makes its iterators of the dataset in
the same order, one a stage: a reshuffling `shuffle` draws each iterator's seeds from one
generator of the dataset's (TensorFlow shares it between every iterator of that dataset
object), and an in-memory `cache()` is filled by the first iterator that reads it to its
end. So nothing may read a batch "to look": `batch_size` reads the batch size from the
graph. What cannot replay is a draw whose order depends on threads: a stateful random op
(`tf.random.uniform`, a `tf.random.Generator`) or a variable assigned (a Keras random
layer's seed) inside a parallel `map` or `interleave`; `unreplayable` names them.

Example:

    >>> dataset = tf.data.Dataset.range(10).batch(4).prefetch(2).cache()
    >>> batch_size(dataset)
    4
"""

import tensorflow as tf

# Datasets whose batches are their input's, as to the batch's rows.
_PASSING = ("Prefetch", "Cache", "Map", "Options", "Take", "Skip", "Repeat", "Shuffle", "Filter",
            "IgnoreErrors", "Assert", "Snapshot", "Finite", "Apply", "_Variant")
_BATCHING = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")
_PARALLEL = ("ParallelMap", "ParallelInterleave", "MapAndBatch", "ParallelBatch")
_STATEFUL_RANDOM = {"RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
                    "RandomShuffle", "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
                    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt",
                    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "RngReadAndSkip", "RngSkip",
                    "AssignAddVariableOp", "AssignVariableOp", "AssignSubVariableOp"}


def batch_size(dataset: tf.data.Dataset) -> int | None:
    """The rows of `dataset`'s batches: its element's static first dimension, else its
    `batch` op's constant batch size where only row-preserving ops (prefetch, cache, map,
    shuffle, ...) follow it; `None` when the graph does not say."""
    first = tf.nest.flatten(dataset.element_spec)[0].shape
    if first.rank and first[0] is not None:
        return int(first[0])
    while dataset is not None:
        kind = type(dataset).__name__
        if kind in _BATCHING:
            value = tf.get_static_value(dataset._batch_size)  # pylint: disable=protected-access
            return None if value is None else int(value)
        if not any(word in kind for word in _PASSING):
            return None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def unreplayable(dataset: tf.data.Dataset) -> list[str]:
    """`"<op> in <dataset op>"` for each draw whose order follows threads: a stateful
    random op or a variable assign in the function of a parallel map or interleave (or a
    function it calls). Empty when the graph cannot be read."""
    try:
        graph = tf.compat.v1.GraphDef.FromString(
            dataset._as_serialized_graph(external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE)  # pylint: disable=protected-access
            .numpy())
    except (tf.errors.OpError, ValueError, TypeError):
        return []
    functions = {f.signature.name: f for f in graph.library.function}
    found = []
    for node in graph.node:
        if not any(word in node.op for word in _PARALLEL):
            continue
        for attr in node.attr.values():
            if attr.func.name:
                found += [f"{op} in {node.op}" for op in sorted(_ops_of(attr.func.name, functions, set()))
                          if op in _STATEFUL_RANDOM]
    return sorted(set(found))


def _ops_of(name: str, functions: dict, seen: set) -> set:
    """Every op type of function `name` and of the functions it calls."""
    if name in seen or name not in functions:
        return set()
    seen.add(name)
    ops = set()
    for node in functions[name].node_def:
        ops.add(node.op)
        if node.op in functions:
            ops |= _ops_of(node.op, functions, seen)
        for attr in node.attr.values():
            if attr.func.name:
                ops |= _ops_of(attr.func.name, functions, seen)
    return ops
