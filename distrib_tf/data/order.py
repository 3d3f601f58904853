"""The data order: which examples each replica trains on at each global step, holding nothing.

Global step `s` trains on positions `(s mod S)·B … (s mod S)·B + B - 1` of data epoch
`s div S` (`S` steps an epoch, `B` the global batch). A position maps to an example id
through `tf.random.experimental.index_shuffle`, a bijection of `[0, N)` keyed by
`(seed, epoch)` (the identity for data that is not shuffled, such as the test split), so
an epoch is a permutation of the examples without any permutation being held. Replica
`r` of `R` takes slice `r` of the global batch, `B / R` positions long; input pipeline
`i` feeds replicas `i·L … i·L + L - 1` (`L` = R / pipelines), one batch each in turn.

The order is a pure function of `(seed, epoch, position)`: one process, several replicas
or several workers train on the same global batches, and a run resumed at step `s`
starts at step `s` without reading anything before it. The state of a run is its step.

Example:

    >>> ids = replica_batches(num_examples=100, steps_per_epoch=3, global_batch_size=32,
    ...                       replicas=4, pipeline=(0, 2), seed=0, shuffle=True)
    >>> [len(batch) for batch in ids.take(2)]  # Replicas 0 and 1 of step 0, 8 ids each.
    [8, 8]
"""

import tensorflow as tf

FOREVER = 2**62  # Steps: the pipeline never ends; Keras counts the steps.


def example_ids(positions, epoch, *, num_examples: int, seed: int, shuffle: bool) -> tf.Tensor:
    """The example id at each of `positions` (int64) in data epoch `epoch`."""
    positions = tf.cast(positions, tf.int64)
    if not shuffle:
        return positions
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.index_shuffle(positions, seed=key, max_index=num_examples - 1)


def replica_batches(*, num_examples: int, steps_per_epoch: int, global_batch_size: int, replicas: int,
                    pipeline: tuple[int, int] = (0, 1), seed: int = 0, shuffle: bool = True,
                    start_step: int = 0) -> tf.data.Dataset:
    """The example ids of one input pipeline: one `[B / R]` int64 vector per (step, replica).

    Args:
        num_examples: examples in the split (`N`); positions beyond `S·B` are never used.
        steps_per_epoch: `S`, with `S·B <= N`.
        global_batch_size: `B`, a multiple of `replicas`.
        replicas: `R`, replicas in sync.
        pipeline: `(index, count)` of this input pipeline; `count` divides `replicas`.
        seed: the shuffle's key, with the epoch.
        shuffle: `False` keeps positions as ids (the test split).
        start_step: the first global step (a resume).
    """
    if steps_per_epoch * global_batch_size > num_examples:
        raise ValueError(f"Invalid value for `steps_per_epoch`. Received: {steps_per_epoch}. Expected at most "
                         f"{num_examples // global_batch_size} steps of {global_batch_size} in {num_examples} "
                         "examples.")
    index, count = pipeline
    local = replicas // count
    batch = global_batch_size // replicas
    first = index * local * batch  # This pipeline's first position within a global batch.

    def step_ids(step):
        epoch, offset = step // steps_per_epoch, (step % steps_per_epoch) * global_batch_size
        positions = offset + first + tf.range(local * batch, dtype=tf.int64)
        ids = example_ids(positions, epoch, num_examples=num_examples, seed=seed, shuffle=shuffle)
        return tf.reshape(ids, [local, batch])

    return tf.data.Dataset.range(start_step, FOREVER).map(step_ids).unbatch()
