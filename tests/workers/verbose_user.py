"""A Keras user's script that asks for Keras's progress bars: `fit`, `evaluate` and `predict`
with `verbose=1` under a live `distrib_tf.Run`. Prints `== fit`, `== evaluate`, `== predict`
and `== end` between them, so a test can read what each printed on each worker.

    python tests/workers/verbose_user.py MODEL_DIR
"""

import sys

import keras
import numpy as np

import distrib_tf


def main():
    run = distrib_tf.Run(sys.argv[1])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    for name, call in (("fit", lambda: model.fit(x, y, batch_size=16, epochs=2, verbose=1)),
                       ("evaluate", lambda: model.evaluate(x, y, batch_size=16, verbose=1)),
                       ("predict", lambda: model.predict(x, batch_size=16, verbose=1))):
        print(f"== {name}", flush=True)
        call()
        sys.stdout.flush()
    print("== end", flush=True)
    run.end()


if __name__ == "__main__":
    main()
