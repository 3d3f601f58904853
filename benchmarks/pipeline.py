"""P2, one worker of it: step time on the real input pipeline / on one cached batch.

    pipeline.py MODEL GLOBAL_BATCH STEPS REPS OUT.json

In one run of the main job's model under the strategy from TF_CONFIG: `fit` on the real
pipeline (`distrib_tf.data.make_dataset_fn`) and `fit` on its first batch, cached and
repeated, alternately, REPS times each after one warm-up of each. A step's time is the
median gap between consecutive `on_train_batch_end` calls, the first 3 steps of each
`fit` left out (iterator start-up). The chief writes both lists of step times.
"""

import json
import statistics
import sys
import time

import distrib_tf

strategy = distrib_tf.make_strategy()

import keras  # noqa: E402

from distrib_tf import data  # noqa: E402
from distrib_tf.train import TrainConfig  # noqa: E402
from distrib_tf.train.job import build_compiled_model  # noqa: E402


class StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def step_seconds(self):
        gaps = [b - a for a, b in zip(self.ends[3:], self.ends[4:])]
        return statistics.median(gaps)


def main():
    model_name, global_batch, steps, reps, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    dataset = sys.argv[6] if len(sys.argv) > 6 else ""  # Default: the model's offline dataset.
    config = TrainConfig(model=model_name, dataset=dataset, global_batch_size=global_batch)
    info = data.load_info(config.dataset)
    model = build_compiled_model(config, info, strategy)
    real_fn = data.make_dataset_fn(info, "train", global_batch_size=global_batch, seed=0)
    sides = {
        "real": lambda: strategy.distribute_datasets_from_function(real_fn),
        "cached": lambda: strategy.distribute_datasets_from_function(
            lambda context: real_fn(context).take(1).cache().repeat()),
    }
    times = {side: [] for side in sides}
    timer = StepTimes()
    for rep in range(reps + 1):
        for side in (sides if rep % 2 else reversed(list(sides))):  # Alternate which goes first.
            model.fit(sides[side](), epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0)
            if rep:  # Rep 0 warms both up.
                times[side].append(timer.step_seconds())
    if strategy.extended.should_checkpoint:
        with open(out, "w") as f:
            json.dump(times, f)


if __name__ == "__main__":
    main()
