"""Epoch metrics and an `evaluate` inside a callback, under a `distrib_tf.Run` of 2 replicas
in one process (`cpu_replicas=2`), then in plain Keras after the run ends (one device).

Two models, each trained on the same rows in order: keras.io's custom `train_step` with its
own metrics ("Customizing what happens in fit()", going lower-level), an AUC and a Precision
among them; and a compiled `Sequential` whose callback calls `evaluate` at each epoch's end.
Prints `RESULT {"run": ..., "plain": ...}`: each one's History, weights and what `evaluate`
returned inside `fit`.
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import distrib_tf


class OwnMetrics(keras.Model):
    """keras.io's custom `train_step` with the model's own metrics."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.auc = keras.metrics.AUC(name="auc")
        self.precision = keras.metrics.Precision(name="precision")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.auc.update_state(y, y_pred)
        self.precision.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.auc, self.precision]


class Evaluates(keras.callbacks.Callback):
    """Calls `evaluate` at each epoch's end, as a user's callback may."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.returned = x, y, []

    def on_epoch_end(self, epoch, logs=None):
        self.returned.append(np.ravel(self.model.evaluate(self.x, self.y, batch_size=16, verbose=0)).tolist())


def _weights(model):
    return np.concatenate([w.ravel() for w in model.get_weights()]).astype("float64").tolist()


def train(x, y):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    own = OwnMetrics(inputs, keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(4)(inputs)))
    own.compile(optimizer="sgd", loss="binary_crossentropy")
    own_history = own.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras.utils.set_random_seed(0)
    compiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1, activation="sigmoid")])
    compiled.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy", keras.metrics.AUC(name="auc")])
    evaluates = Evaluates(x[:32], y[:32])
    compiled_history = compiled.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[evaluates])
    return {"own": {"history": own_history.history, "weights": _weights(own)},
            "compiled": {"history": compiled_history.history, "weights": _weights(compiled),
                         "evaluate_in_fit": evaluates.returned}}


def main():
    rng = np.random.RandomState(0)
    x = rng.rand(64, 4).astype("float32")
    y = (x.sum(axis=1) + rng.rand(64) > 2.5).astype("float32")
    run = distrib_tf.Run(sys.argv[1], strategy="mirrored", cpu_replicas=2, exit_on_error=False)
    under_run = train(x, y)
    run.end()
    print("RESULT " + json.dumps({"run": under_run, "plain": train(x, y)}), flush=True)


if __name__ == "__main__":
    main()
