"""Faults that the worker scripts act from inside `fit`, as a scheduler would from outside."""

import os
import signal

import keras


class Fault(keras.callbacks.Callback):
    """SIGTERM to this process once the optimizer has taken `step` steps (at a batch's end).

    `optimizer`: the model's attribute that counts them (a GAN's `d_optimizer`: its
    `model.optimizer` takes none)."""

    def __init__(self, step, optimizer: str = "optimizer"):
        super().__init__()
        self.step, self.optimizer = step, optimizer

    def taken(self) -> int:
        return int(getattr(self.model, self.optimizer).iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        if self.taken() == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Crash(Fault):
    """Raises once the optimizer has taken `step` steps: the process dies there (its backups stay)."""

    def on_train_batch_end(self, batch, logs=None):
        if self.taken() == self.step:
            raise RuntimeError("crashed")
