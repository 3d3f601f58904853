"""keras.io's DCGAN shape (two optimizers of its own, `model.optimizer` never moved) under a
run on 2 logical CPU devices: trained uninterrupted, then crashed at a step inside an epoch
in another model_dir (one process), then resumed there (a second process: a run resumed in
a process where a run on logical CPU devices trained before fails a collective of its
`Progress`, "Collective instance ... expected ... data_type 2 but got ... data_type 1",
with any model).

    python gan_resume.py OUT            # uninterrupted, then crashed
    python gan_resume.py OUT --resume   # resumed

Writes OUT/first.json (for the uninterrupted run its weights, each optimizer's variables and
iterations, and `resumed_at_step`; the backups' steps the crash left), OUT/resumed.json (the
same of the resumed run).

On the workers of a cluster (each with its TF_CONFIG), one phase a launch, each worker on a
disk of its own (model_dir OUT/<uninterrupted or crashed>/host-<task index>), writing
OUT/<phase>-<task index>.json:

    python gan_resume.py OUT --workers uninterrupted|crashed|resumed
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from faults import Crash
from keras_io_shapes import gan_images
from keras_io_shapes import make_gan

import distrib_tf
from distrib_tf.keras import backup

EPOCHS = 3  # 4 steps an epoch: 12 steps.


def train(model_dir, *callbacks, workers=False):
    """The GAN fitted under a run in `model_dir` (on 2 logical CPU devices, or on the workers of
    TF_CONFIG's cluster); its state and the run's summary."""
    keras.backend.clear_session()  # The same variable names each time: the same run to resume.
    layout = {} if workers else {"strategy": "mirrored", "cpu_replicas": 2}
    with distrib_tf.Run(model_dir, backup_every_steps=5, exit_on_error=False, **layout) as run:
        gan = make_gan(keras, tf)
        gan.fit(gan_images(tf), epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
    return {"weights": [w.tolist() for w in gan.get_weights()],
            "optimizers": {name: [np.asarray(v.numpy()).tolist() for v in getattr(gan, name).variables]
                           for name in ("d_optimizer", "g_optimizer")},
            "iterations": [int(getattr(gan, name).iterations.numpy()) for name in ("d_optimizer", "g_optimizer")],
            "resumed_at_step": run.summary["resumed_at_step"]}


def main():
    out = sys.argv[1]
    keras.config.set_floatx("float64")
    crashed = os.path.join(out, "crashed")
    if sys.argv[2:3] == ["--workers"]:
        phase, index = sys.argv[3], json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        callbacks = [Crash(7, optimizer="d_optimizer")] if phase == "crashed" else []
        try:
            result = train(os.path.join(out, "uninterrupted" if phase == "uninterrupted" else "crashed",
                                        f"host-{index}"), *callbacks, workers=True)
        except RuntimeError as error:
            result = {"crash": str(error)}
        with open(os.path.join(out, f"{phase}-{index}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0
    if sys.argv[2:] == ["--resume"]:
        result, name = train(crashed), "resumed.json"
    else:
        result, name = {"uninterrupted": train(os.path.join(out, "uninterrupted"))}, "first.json"
        try:
            train(crashed, Crash(7, optimizer="d_optimizer"))  # Epoch 2, step 3 of it.
        except RuntimeError as error:
            result["crash"] = str(error)
        result["backups"] = [b["step"] for b in backup.list_backups(os.path.join(crashed, "backup", "chief-0"))]
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
