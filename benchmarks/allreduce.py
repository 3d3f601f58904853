"""P3, one worker of it: seconds of each of R all-reduces of N MB (a ring of 2 workers).

    allreduce.py SIZES_MB REPEATS PIECES BYTES_PER_PACK OUT.json

The chief writes every time, by size.
"""

import json
import sys
import time

import distrib_tf


def _make_step(strategy, tensors):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    @tf.function
    def step():
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce("SUM", tensors)
        return strategy.run(replica_fn)

    return step


def main():
    sizes_mb = sys.argv[1].split(",")
    repeats, pieces, bytes_per_pack, out = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    strategy = distrib_tf.make_strategy("multi_worker", communication="ring", bytes_per_pack=bytes_per_pack)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    results = {}
    for size in sizes_mb:
        elements = int(float(size) * 2**20 / 4 / pieces)
        step = _make_step(strategy, [tf.ones([elements]) for _ in range(pieces)])
        step()  # Trace and warm up.
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = step()
            _ = [t.numpy()[0] for t in tf.nest.flatten(strategy.experimental_local_results(result))[:1]]
            times.append(time.perf_counter() - start)
        results[size] = times
    if strategy.extended.should_checkpoint:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
