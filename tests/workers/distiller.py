"""keras.io's knowledge distillation (`Distiller`, a `keras.Model` whose `compute_loss`
override has no `training` argument), tiny: a random teacher, a student trained a few steps.

`python distiller.py MODEL_DIR run` trains under `distrib_tf.Run(MODEL_DIR)` (on the
workers of TF_CONFIG); `... plain` is plain Keras in one process. Prints `RESULT {...}`:
the History, the iterations, the student's weights and its evaluate.
"""

import json
import sys

import keras
import numpy as np
from keras import ops

import distrib_tf


class Distiller(keras.Model):
    """keras.io's, as it is there (examples/vision/knowledge_distillation.py)."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):  # pylint: disable=arguments-differ
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):  # pylint: disable=arguments-differ
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def main():
    model_dir, mode = sys.argv[1], sys.argv[2]
    run = distrib_tf.Run(model_dir) if mode == "run" else None
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = x[:, :4].argmax(axis=1)
    keras.utils.set_random_seed(0)
    teacher = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    student = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(optimizer=keras.optimizers.Adam(), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
    history = distiller.fit(x, y, batch_size=16, epochs=2, shuffle=False, validation_data=(x[:32], y[:32]),
                            verbose=0)
    evaluated = distiller.evaluate(x, y, batch_size=16, return_dict=True, verbose=0)
    print("RESULT " + json.dumps({
        "history": history.history, "iterations": int(distiller.optimizer.iterations.numpy()),
        "weights": np.concatenate([w.ravel() for w in student.get_weights()]).astype("float64").tolist(),
        "evaluate": evaluated}), flush=True)
    if run is not None:
        run.end()


if __name__ == "__main__":
    main()
