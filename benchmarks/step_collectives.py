"""One worker of `make bench-scaling`'s bound: the main job's step collectives alone, nothing else in TensorFlow.

    step_collectives.py MODEL LOGGED STEPS OUT.json [PAUSE]     # TF_CONFIG set, as for the job

Builds the main job's compiled model (`distrib_tf.train.job.build_compiled_model`: the same
variables, optimizer and patched gradient all-reduce) under the same strategy, then times
STEPS calls of a `tf.function` that holds what a training step's graph holds of
communication and nothing else: the gradients' all-reduce, through the optimizer's own path
(one pack, last layers first), on zeros shaped like the trainable variables, with LOGGED
scalars in the same pack (`distrib_tf.keras.step_logs`).

Each call ends by reading one value on the host, as a step's callbacks do. With PAUSE (seconds),
each call comes after that long a computation on the host (numpy, outside TensorFlow), as a
step's all-reduce comes after its forward and backward pass; without, the calls run back to
back. Only the calls are timed. The chief writes
`{"gradient_bytes", "step_seconds": [...]}` (every call's seconds after 20 warm-up calls).
"""

import json
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from distrib_tf.train.config import TrainConfig
from distrib_tf.train.job import build_compiled_model
from distrib_tf.train.job import prepare_job

WARM_UP = 20


def compute(seconds: float) -> None:
    """Keeps this core busy for `seconds`, none of it in TensorFlow."""
    end, a = time.perf_counter() + seconds, np.ones((64, 64), np.float32)
    while time.perf_counter() < end:
        a = (a @ a) * 1e-3


def make_step(strategy, model, logged: int):
    variables = model.trainable_variables
    optimizer = model.optimizer

    def replica():
        pairs = [(tf.zeros(v.shape, v.dtype), v) for v in variables]
        pairs.append((tf.range(logged, dtype=variables[0].dtype), None))  # The logs, in the gradients' pack.
        reduced = optimizer._all_reduce_sum_gradients(pairs)  # pylint: disable=protected-access
        return tf.unstack(reduced[-1][0])

    @tf.function
    def step():
        return [strategy.experimental_local_results(v)[0] for v in strategy.run(replica)]

    return step


def main():
    model_name, logged, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    config = TrainConfig(model=model_name, epochs=1, global_batch_size=64)
    with tempfile.TemporaryDirectory() as model_dir:
        job = prepare_job(config, model_dir)
        strategy = job.run.strategy
        model = build_compiled_model(config, job.info, strategy)
        step = make_step(strategy, model, logged)
        seconds = []
        for call in range(WARM_UP + steps):
            if pause:
                compute(pause)
            start = time.perf_counter()
            float(step()[0])
            if call >= WARM_UP:
                seconds.append(time.perf_counter() - start)
    if job.run.is_chief:
        gradient_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)
        with open(out, "w") as f:
            json.dump({"gradient_bytes": gradient_bytes, "step_seconds": seconds}, f)


if __name__ == "__main__":
    main()
