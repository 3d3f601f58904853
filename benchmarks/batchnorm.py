"""What a synchronized BatchNormalization costs a step against a plain one, on 2 workers.

    python benchmarks/batchnorm.py [--rounds=3] [--out=benchmarks/batchnorm.json]

A small conv net (two Conv2D + BatchNormalization blocks, 16x16x3 inputs, global batch 64)
trains under a `distrib_tf.Run` on 2 local workers, three ways, interleaved round by round:
`plain` (the moving statistics averaged after every step, `distrib_tf.keras.replica_state`),
`plain_unaveraged` (that average taken out: what it costs) and `synchronized`
(`BatchNormalization(synchronized=True)`: the batch statistics all-reduced in every layer,
forward and backward). Each run's figure is the median step of its second epoch (the time
between batch ends on the chief). Writes every run's figures and each way's median.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

STEPS, GLOBAL_BATCH, EPOCHS = 30, 64, 2
WAYS = ("plain", "plain_unaveraged", "synchronized")


def worker(way: str, out: str) -> None:
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    import distrib_tf  # pylint: disable=import-outside-toplevel
    from distrib_tf.keras import replica_state  # pylint: disable=import-outside-toplevel

    if way == "plain_unaveraged":
        replica_state.AverageReplicaState.on_train_batch_end = lambda self, batch, logs=None: None
    run = distrib_tf.Run(os.path.join(out, "run"), seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, size=(STEPS * GLOBAL_BATCH,))
    layers = [keras.Input((16, 16, 3))]
    for filters in (16, 32):
        layers += [keras.layers.Conv2D(filters, 3, padding="same", use_bias=False),
                   keras.layers.BatchNormalization(synchronized=way == "synchronized"), keras.layers.ReLU()]
    model = keras.Sequential([*layers, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, callbacks=[Clock()], verbose=0)
    if run.is_chief:
        second = np.diff(ends[STEPS - 1:])
        with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as f:
            json.dump({"median_step_seconds": float(np.median(second))}, f)


def one_run(way: str) -> float:
    from distrib_tf.cluster import ClusterSpec  # pylint: disable=import-outside-toplevel
    spec = ClusterSpec.from_dict({"cluster": {"worker": ["127.0.0.1:0"] * 2}}).with_free_ports()
    with tempfile.TemporaryDirectory() as out:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", way, out],
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": spec.tf_config(t)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for t in spec.tasks]
        for proc in procs:
            if proc.wait(timeout=300):
                raise RuntimeError(f"{way}: a worker exited {proc.returncode}")
        with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
            return json.load(f)["median_step_seconds"]


def main():
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "batchnorm.json"))
    args = parser.parse_args()
    runs = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            runs[way].append(one_run(way))
            print(way, f"{runs[way][-1] * 1000:.1f} ms", flush=True)
    summary = {way: {"median_step_ms": sorted(v)[len(v) // 2] * 1000, "runs_ms": [s * 1000 for s in v]}
               for way, v in runs.items()}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
