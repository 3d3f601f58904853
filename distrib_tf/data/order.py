"""The data order: which examples each replica trains on at each global step, holding nothing.

Global step `s` trains on positions `(s mod S)·B … (s mod S)·B + n - 1` of data epoch
`s div S` (`S` steps an epoch, `B` the global batch, `n = min(B, N - (s mod S)·B)`: Keras's
last batch of an epoch holds the rest of the `N` examples). A position maps to an example
id through `tf.random.experimental.index_shuffle`, a bijection of `[0, N)` keyed by
`(seed, epoch)` (the identity for data that is not shuffled, such as the test split), so
an epoch is a permutation of the examples without any permutation being held. Replica
`r` of `R` takes positions `⌊r·n/R⌋ … ⌊(r+1)·n/R⌋ - 1` of the step's batch (`B / R` each
where `R` divides it; else shares one apart, some empty where `n < R`); input pipeline
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
    """The example id at each of `positions` (an int64 vector) in data epoch `epoch`."""
    positions = tf.cast(positions, tf.int64)
    if not shuffle:
        return positions
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    padded = tf.concat([positions, [0]], 0)  # A replica's empty share too: the op refuses an empty vector.
    return tf.random.experimental.index_shuffle(padded, seed=key, max_index=num_examples - 1)[:-1]


def replica_batches(*, num_examples: int, steps_per_epoch: int, global_batch_size: int, replicas: int,
                    pipeline: tuple[int, int] = (0, 1), seed: int = 0, shuffle: bool = True,
                    start_step: int = 0) -> tf.data.Dataset:
    """The example ids of one input pipeline: one int64 vector per (step, replica), `[B / R]`
    where every step is a full batch that the replicas divide, else `[None]`.

    Args:
        num_examples: examples in the split (`N`); positions beyond `S·B` are never used.
        steps_per_epoch: `S`, at most `⌈N / B⌉` (the last step then holds the rest).
        global_batch_size: `B`.
        replicas: `R`, replicas in sync.
        pipeline: `(index, count)` of this input pipeline; `count` divides `replicas`.
        seed: the shuffle's key, with the epoch.
        shuffle: `False` keeps positions as ids (the test split).
        start_step: the first global step (a resume).
    """
    if (steps_per_epoch - 1) * global_batch_size >= num_examples:
        raise ValueError(f"Invalid value for `steps_per_epoch`. Received: {steps_per_epoch}. Expected at most "
                         f"{-(-num_examples // global_batch_size)} steps of {global_batch_size} in {num_examples} "
                         "examples.")
    index, count = pipeline
    local = replicas // count
    even = steps_per_epoch * global_batch_size <= num_examples and global_batch_size % replicas == 0
    first = tf.range(index * local, (index + 1) * local, dtype=tf.int64)  # This pipeline's replicas.

    def step_slices(step):
        offset = (step % steps_per_epoch) * global_batch_size
        rows = tf.minimum(tf.constant(global_batch_size, tf.int64), num_examples - offset)
        return (tf.fill([local], step // steps_per_epoch),
                offset + first * rows // replicas, offset + (first + 1) * rows // replicas)

    def slice_ids(epoch, start, end):
        ids = example_ids(tf.range(start, end), epoch, num_examples=num_examples, seed=seed, shuffle=shuffle)
        if even:
            ids.set_shape([global_batch_size // replicas])
        return ids

    return tf.data.Dataset.range(start_step, FOREVER).map(step_slices).unbatch().map(slice_ids)
