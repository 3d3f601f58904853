"""A side-car evaluator: evaluates each checkpoint the chief writes, as it appears.

An `evaluator` task in the cluster spec runs no training and joins no collective (its
strategy is local). It watches `model_dir/checkpoints/` for `epochNNN.weights.h5` (the
chief writes each one atomically), evaluates it on the test split, and writes only into
`model_dir/eval/`:

- `eval.json`: `{"checkpoints": [{"epoch": 1, "checkpoint": "epoch001.weights.h5",
  "loss": ..., "accuracy": ...}, ...]}`, rewritten atomically after each checkpoint;
- TensorBoard scalars (`eval/events.out.tfevents...`), one point per epoch.

It returns after the checkpoint of the last epoch. Restarted (by the launcher), it
skips the checkpoints `eval.json` already holds. It must see the chief's
`checkpoints/`: run it on the chief's host or give both a shared `model_dir`.

Example:

    >>> evaluate_checkpoints(model, dataset, steps=32, model_dir="/tmp/run", last_epoch=3)
"""

import glob
import json
import os
import re
import time

import tensorflow as tf

from distrib_tf.keras import backup

_CHECKPOINT = re.compile(r"epoch(\d+)\.weights\.h5$")


def _checkpoints(model_dir: str) -> list[tuple[int, str]]:
    found = []
    for path in glob.glob(os.path.join(glob.escape(model_dir), "checkpoints", "epoch*.weights.h5")):
        match = _CHECKPOINT.search(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def evaluate_checkpoints(model, dataset, *, steps: int, model_dir: str, last_epoch: int,
                         poll_seconds: float = 1.0) -> list[dict]:
    """Evaluates every checkpoint up to `last_epoch` as it appears; returns all results.

    Args:
        model: a compiled model of the same architecture as the chief's.
        dataset: the test data, as the chief evaluates it.
        steps: evaluation steps per checkpoint (the chief's `validation_steps`).
        model_dir: the chief's `model_dir`; results go to `model_dir/eval/`.
        last_epoch: return after the checkpoint of this epoch.
        poll_seconds: how often to look for new checkpoints.
    """
    eval_dir = os.path.join(model_dir, "eval")
    os.makedirs(eval_dir, mode=0o700, exist_ok=True)
    json_path = os.path.join(eval_dir, "eval.json")
    results = []
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            results = json.load(f)["checkpoints"]
    done = {r["epoch"] for r in results}
    writer = tf.summary.create_file_writer(eval_dir)
    while last_epoch not in done:
        for epoch, path in _checkpoints(model_dir):
            if epoch in done or epoch > last_epoch:
                continue
            model.load_weights(path)
            metrics = model.evaluate(dataset, steps=steps, return_dict=True, verbose=0)
            results.append({"epoch": epoch, "checkpoint": os.path.basename(path),
                            **{k: float(v) for k, v in metrics.items()}})
            done.add(epoch)
            with writer.as_default():
                for name, value in metrics.items():
                    tf.summary.scalar(f"eval/{name}", float(value), step=epoch)
            writer.flush()
            backup.write_json_atomically(json_path, {"checkpoints": sorted(results, key=lambda r: r["epoch"])})
            print(f"evaluator: epoch {epoch} " + " ".join(
                f"{k}={float(v):.4g}" for k, v in sorted(metrics.items())), flush=True)
        if last_epoch not in done:
            time.sleep(poll_seconds)
    writer.close()
    return sorted(results, key=lambda r: r["epoch"])
