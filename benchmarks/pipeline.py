"""Examples per second of a main-job input pipeline alone (one process, no training)."""

import json
import sys
import time

import tensorflow as tf

from distrib_tf import data


def main():
    name, global_batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    info = data.load_info(name)
    dataset = data.make_dataset_fn(info, "train", global_batch_size=global_batch)(tf.distribute.InputContext())
    iterator = iter(dataset)
    for _ in range(max(steps, data.steps_per_epoch(info, "train", global_batch))):  # One pass fills the cache.
        next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    print(json.dumps({"examples_per_second": steps * global_batch / (time.perf_counter() - start)}))


if __name__ == "__main__":
    main()
