"""compile() options that cannot run on several replicas: with and without the check."""

import json

import numpy as np

import distrib_tf


def fit_outcome(strategy, **compile_args):
    import keras  # pylint: disable=import-outside-toplevel

    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", **compile_args)
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    except Exception as e:  # pylint: disable=broad-except
        return f"{type(e).__name__}: {e}"
    return "ok"


def main():
    strategy = distrib_tf.make_strategy("mirrored", cpu_replicas=2)
    from distrib_tf.keras import compat  # pylint: disable=import-outside-toplevel

    cases = {"steps_per_execution": {"steps_per_execution": 2}, "jit_compile": {"jit_compile": True}}
    outcomes = {name: {"with_fix": fit_outcome(strategy, **args)} for name, args in cases.items()}
    compat.revert("compile_checks")
    for name, args in cases.items():
        outcomes[name]["without_fix"] = fit_outcome(strategy, **args)
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
