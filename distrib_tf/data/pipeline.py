"""`tf.data` pipelines that give every worker its own examples, in an order no layout changes.

`make_dataset_fn()` returns the function that `strategy.distribute_datasets_from_function`
calls once per input pipeline with a `tf.distribute.InputContext`. Each pipeline turns
the global steps from `start_step` on into its replicas' example ids
(`distrib_tf.data.order`), reads just those examples (`distrib_tf.data.readers`), a batch
at a time and several batches in parallel, and prefetches. TensorFlow's own
auto-sharding is switched off: the order already splits the work.

Example:

    >>> info = load_info("shapes")
    >>> dataset_fn = make_dataset_fn(info, "train", global_batch_size=64)
    >>> dataset = dataset_fn(tf.distribute.InputContext())  # One pipeline: every replica.
"""

import logging

import tensorflow as tf

from distrib_tf.data import order
from distrib_tf.data import readers
from distrib_tf.data.registry import DatasetInfo
from distrib_tf.data.registry import check_global_batch_size
from distrib_tf.data.registry import steps_per_epoch

logger = logging.getLogger("distrib_tf")
_SAID: set = set()  # The pipelines this process described.


def make_dataset_fn(info: DatasetInfo, split: str, *, global_batch_size: int, seed: int = 0,
                    start_step: int = 0):
    """Returns `dataset_fn(input_context)` for `distribute_datasets_from_function`.

    Global step `s` trains on the global batch `s mod S` (`S = steps_per_epoch`) of data
    epoch `s div S`; an epoch is a permutation of the split keyed by `(seed, epoch)` (the
    test split keeps its order). Each replica takes its slice of every global batch, so
    one process, 2 replicas or 4 workers train on the same global batches in the same
    order, and a pipeline reads only its own replicas' examples. Resuming at
    `start_step` starts there: nothing before it is read.
    """
    examples_fn = make_examples_fn(
        f"{info.name} {split}", info.num_examples[split], lambda: readers.make_reader(info, split),
        global_batch_size=global_batch_size, steps_per_epoch=steps_per_epoch(info, split, global_batch_size),
        seed=seed, shuffle=split == "train", start_step=start_step)

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        check_global_batch_size(global_batch_size, input_context.num_replicas_in_sync)
        return examples_fn(input_context)

    return dataset_fn


def make_examples_fn(name: str, num_examples: int, make_reader, *, global_batch_size: int,
                     steps_per_epoch: int, seed: int = 0, shuffle: bool = True, start_step: int = 0,
                     one_pass: bool = False):
    """`make_dataset_fn` for any examples read by id: `make_reader()` returns `read(ids)`,
    called once in each input pipeline (`distrib_tf.data.examples`). `one_pass`: the
    steps from `start_step` to the end of its epoch, then the end (for `evaluate`). A last
    step of fewer than `global_batch_size` examples, or a batch the replicas do not divide,
    is split as evenly as it goes (`distrib_tf.data.order`)."""

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        replicas = input_context.num_replicas_in_sync
        pipelines, index = input_context.num_input_pipelines, input_context.input_pipeline_id
        ids = order.replica_batches(
            num_examples=num_examples, steps_per_epoch=steps_per_epoch, global_batch_size=global_batch_size,
            replicas=replicas, pipeline=(index, pipelines), seed=seed, shuffle=shuffle,
            start_step=start_step)
        if one_pass:
            ids = ids.take(steps_per_epoch - start_step % steps_per_epoch)
        dataset = ids.map(make_reader(), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        said = (name, index, pipelines, replicas // pipelines)
        if said not in _SAID:  # Once a process: not again for each evaluate or restart of the epoch.
            _SAID.add(said)
            logger.info("%s: input pipeline %d of %d reads its %d replica slice(s) of every global batch", *said)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # Known to be endless, so that a multi-worker strategy does not all-reduce "has
        # data" across the workers before every step (its partial-batch handling).
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(
            steps_per_epoch - start_step % steps_per_epoch if one_pass else tf.data.INFINITE_CARDINALITY))
        return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)

    return dataset_fn
