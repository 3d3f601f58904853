"""Two keras.io model shapes that compat fix 1 once failed to build, trained by a script.

keras.io's "Timeseries forecasting for weather prediction" (a Functional LSTM fed by
`timeseries_dataset_from_array`, whose window length the dataset leaves unknown) and its
DCGAN (a Model subclass with no `call`, its own `compile` and a `train_step` with two
optimizers), shrunk. The GAN's latent vectors come from its real images (keras.io draws
them at random) so that one process and several replicas see the same numbers.

    python keras_io_shapes.py OUT            # plain Keras, one process, no distrib_tf
    python keras_io_shapes.py OUT --replicas 2  # distrib_tf.Run over 2 logical CPU devices

Writes OUT/result.json: each shape's History, optimizer iterations and weights; with
`--replicas`, also what Keras's own `fit` raised on the GAN without fix 1 and without fix 12.
"""

import argparse
import json
import os
import sys

import numpy as np

LATENT = 4


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas", type=int, default=0, help="train under distrib_tf.Run on this many CPU replicas")
    return parser.parse_args()


def train_timeseries(keras):
    rows = np.random.RandomState(0).rand(203, 3)
    # 192 windows of 12 rows (the length the dataset leaves unknown), 12 batches of 16.
    data = keras.utils.timeseries_dataset_from_array(rows, np.roll(rows[:, 0], -12), sequence_length=12,
                                                     batch_size=16)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12, 3))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(4)(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(data, epochs=2, verbose=0)
    return {"history": history.history, "iterations": [int(model.optimizer.iterations.numpy())],
            "weights": [w.tolist() for w in model.get_weights()]}


def make_gan(keras, tf):
    layers, ops = keras.layers, keras.ops

    class GAN(keras.Model):  # keras.io's DCGAN, its random draws aside.
        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator

        def compile(self, d_optimizer, g_optimizer, loss_fn):  # pylint: disable=arguments-differ
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, real_images):  # pylint: disable=arguments-renamed
            batch_size = ops.shape(real_images)[0]
            latent = ops.reshape(real_images, (batch_size, -1))[:, :LATENT]
            combined = ops.concatenate([self.generator(latent), real_images], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(ops.zeros((batch_size, 1)), self.discriminator(self.generator(latent)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

    keras.utils.set_random_seed(2)
    discriminator = keras.Sequential([
        keras.Input((8, 8, 1)), layers.Conv2D(4, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
        layers.Flatten(), layers.Dense(1, activation="sigmoid")])
    generator = keras.Sequential([
        keras.Input((LATENT,)), layers.Dense(4 * 4 * 4), layers.Reshape((4, 4, 4)),
        layers.Conv2DTranspose(4, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
        layers.Conv2D(1, 3, padding="same", activation="sigmoid")])
    gan = GAN(discriminator, generator)
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
                loss_fn=keras.losses.BinaryCrossentropy())
    return gan


def gan_images(tf):
    images = np.random.RandomState(3).rand(32, 8, 8, 1)
    return tf.data.Dataset.from_tensor_slices(images).batch(8)  # 4 steps an epoch.


def train_gan(keras, tf):
    gan = make_gan(keras, tf)
    history = gan.fit(gan_images(tf), epochs=2, verbose=0)
    return {"history": history.history,
            "iterations": [int(o.iterations.numpy()) for o in (gan.d_optimizer, gan.g_optimizer)],
            "weights": [w.tolist() for w in gan.get_weights()]}


def keras_fit_without(keras, tf, fix):
    """What Keras's own `fit` (not the run's) raises on a fresh GAN with `fix` removed."""
    from distrib_tf.keras import compat  # pylint: disable=import-outside-toplevel

    with compat.reverted(fix):
        gan = make_gan(keras, tf)
        try:
            super(keras.Model, gan).fit(gan_images(tf), epochs=1, verbose=0)  # Keras's own, past the run's routing.
        except Exception as error:  # pylint: disable=broad-except
            return f"{type(error).__name__}: {error}"
    return "trained"


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    run = None
    if args.replicas:
        import distrib_tf  # pylint: disable=import-outside-toplevel

        run = distrib_tf.Run(os.path.join(args.out, "run"), strategy="mirrored", cpu_replicas=args.replicas,
                             exit_on_error=False)
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    keras.config.set_floatx("float64")
    result = {"timeseries": train_timeseries(keras), "gan": train_gan(keras, tf)}
    if run is not None:
        result["without"] = {fix: keras_fit_without(keras, tf, fix)
                             for fix in ("symbolic_build", "build_across_replicas")}
        run.end()
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
