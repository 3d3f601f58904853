"""The input pipeline's Grain route, for `benchmarks/data.py --grain`: whole slices in child processes.

A Grain `MapDataset` over the global steps from `start_step` on; element `s` is this
pipeline's slice of global batch `s`, its ids from `distrib_tf.data.order` (the same
`index_shuffle`), its records read (`records.RecordReader.rows`) and split into uint8 images
and int64 labels in a child process: numbers, not strings, and no Python object per record
in the process that trains. `mp_prefetch` hands steps to its processes round-robin and takes
them back in order, so the order is exactly `make_dataset_fn`'s; a resume is a range that
starts at `start_step`. The training process turns each slice into tensors
(`Dataset.from_generator`) and makes the images float32 in [0, 1] there, as `ours` does.
"""

import numpy as np

# Threads a child process reads with. Grain's default, 16 threads and 500 slices (750 MB)
# buffered in each child, was several times slower than one thread on 2 cores.
READ_THREADS = 1


class Slices:
    """Element `step`: `(x uint8 [B/2, 64, 64, 3], y int64 [B/2])` of pipeline `index` of 2."""

    def __init__(self, directory: str, index: int, global_batch: int, shape: tuple):
        self.directory, self.index, self.global_batch, self.shape = directory, index, global_batch, shape
        self._reader = self._ids = None

    def _setup(self):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        from distrib_tf.data import order  # pylint: disable=import-outside-toplevel
        from distrib_tf.data import records  # pylint: disable=import-outside-toplevel

        tf.config.threading.set_intra_op_parallelism_threads(1)  # One op a call (the ids): no pools to spin.
        tf.config.threading.set_inter_op_parallelism_threads(1)

        meta = records.read_meta(self.directory)
        shards = records.split_shards(self.directory, meta, "train")
        self._reader = records.RecordReader(shards, record_bytes=int(np.prod(self.shape)) + 8)
        steps = shards.num_records // self.global_batch
        half = self.global_batch // 2

        def ids(step):
            epoch, offset = step // steps, (step % steps) * self.global_batch + self.index * half
            return order.example_ids(np.arange(offset, offset + half), epoch, num_examples=shards.num_records,
                                     seed=0, shuffle=True).numpy()
        self._ids = ids

    def __call__(self, step: int):
        if self._reader is None:
            self._setup()
        rows = self._reader.rows(self._ids(step))
        size = int(np.prod(self.shape))
        return (np.ascontiguousarray(rows[:, :size]).reshape(-1, *self.shape),
                np.ascontiguousarray(rows[:, size:]).view("<i8").reshape(-1))


def dataset(directory: str, index: int, global_batch: int, shape: tuple, *, processes: int, start_step: int = 0):
    """The tf.data pipeline of the Grain route: `processes` child processes."""
    import grain  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    source = grain.MapDataset.range(start_step, 2**62).map(Slices(directory, index, global_batch, shape))
    read = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=2)
    iterator = source.to_iter_dataset(read).mp_prefetch(grain.MultiprocessingOptions(num_workers=processes))
    signature = (tf.TensorSpec([global_batch // 2, *shape], tf.uint8), tf.TensorSpec([global_batch // 2], tf.int64))
    slices = tf.data.Dataset.from_generator(lambda: iter(iterator), output_signature=signature)
    return slices.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).prefetch(tf.data.AUTOTUNE)
