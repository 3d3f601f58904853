"""A side-car evaluator: evaluates each checkpoint the chief writes, as it appears.

An `evaluator` task in the cluster spec runs no training and joins no collective (its
strategy is local). It watches `model_dir/checkpoints/` for `epochNNN.weights.h5` (the
chief writes each one atomically), evaluates it on the test split, and writes only into
`model_dir/eval/`:

- `eval.json`: `{"checkpoints": [{"epoch": 1, "checkpoint": "epoch001.weights.h5",
  "loss": ..., "accuracy": ...}, ...]}`, rewritten atomically after each checkpoint;
- TensorBoard scalars (`eval/events.out.tfevents...`), one point per epoch.

It takes only checkpoints of its own run (the chief names it beside each checkpoint,
`epochNNN.json`): an earlier run's in the same `model_dir` are left alone. It returns
after the checkpoint of the last epoch, or once the run has ended without it (the
chief's `summary.json` of this run, after a NaN stop for example), and raises
`EvaluatorTimeout` after `idle_seconds` without a new checkpoint (the chief's files not
visible here, or a run that died). Restarted (by the launcher), it skips the
checkpoints `eval.json` already holds for this run. It must see the chief's
`checkpoints/`: run it on the chief's host or give both a shared `model_dir`.

Example:

    >>> evaluate_checkpoints(model, dataset, steps=32, model_dir="/tmp/run", last_epoch=3, run=run_id)
"""

import glob
import json
import os
import re
import time

import tensorflow as tf

from distrib_tf.keras import backup

_CHECKPOINT = re.compile(r"epoch(\d+)\.weights\.h5$")


class EvaluatorTimeout(TimeoutError):
    """No checkpoint of this run appeared for too long."""


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _checkpoints(model_dir: str, run: str) -> list[tuple[int, str]]:
    """This run's checkpoints: those whose `epochNNN.json` names `run`."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(model_dir), "checkpoints", "epoch*.weights.h5")):
        match = _CHECKPOINT.search(os.path.basename(path))
        named = _read_json(path[: -len(".weights.h5")] + ".json")
        if match and named is not None and named.get("run") == run:
            found.append((int(match.group(1)), path))
    return sorted(found)


def _run_ended(model_dir: str, run: str) -> bool:
    summary = _read_json(os.path.join(model_dir, "summary.json"))
    return summary is not None and summary.get("run_id") == run


def evaluate_checkpoints(model, dataset, *, steps: int, model_dir: str, last_epoch: int, run: str,
                         poll_seconds: float = 1.0, idle_seconds: float = 3600.0) -> list[dict]:
    """Evaluates every checkpoint of `run` up to `last_epoch` as it appears; returns all results.

    Args:
        model: a compiled model of the same architecture as the chief's.
        dataset: the test data, as the chief evaluates it.
        steps: evaluation steps per checkpoint (the chief's `validation_steps`).
        model_dir: the chief's `model_dir`; results go to `model_dir/eval/`.
        last_epoch: return after the checkpoint of this epoch.
        run: the run's id (`TrainConfig.run_id()`): checkpoints of other runs are skipped.
        poll_seconds: how often to look for new checkpoints.
        idle_seconds: raise `EvaluatorTimeout` after this long without a new one, or after
            3 times the longest wait between two checkpoints seen so far where that is
            longer (an epoch of two hours is waited for once one has been seen).
    """
    eval_dir = os.path.join(model_dir, "eval")
    backup.make_private_dirs(eval_dir)
    json_path = os.path.join(eval_dir, "eval.json")
    earlier = _read_json(json_path) or {}
    results = earlier.get("checkpoints", []) if earlier.get("run") == run else []
    done = {r["epoch"] for r in results}
    writer = tf.summary.create_file_writer(eval_dir)
    last_news = time.monotonic()
    longest_gap = 0.0
    while last_epoch not in done:
        ended = _run_ended(model_dir, run)  # Read first: its checkpoints are all written by then.
        for epoch, path in _checkpoints(model_dir, run):
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
            backup.write_json_atomically(
                json_path, {"run": run, "checkpoints": sorted(results, key=lambda r: r["epoch"])})
            print(f"evaluator: epoch {epoch} " + " ".join(
                f"{k}={float(v):.4g}" for k, v in sorted(metrics.items())), flush=True)
            longest_gap = max(longest_gap, time.monotonic() - last_news)
            last_news = time.monotonic()
        if last_epoch in done or ended:
            break
        patience = max(idle_seconds, 3 * longest_gap)
        if time.monotonic() - last_news > patience:
            raise EvaluatorTimeout(
                f"evaluator: no new checkpoint of this run in {os.path.join(model_dir, 'checkpoints')} "
                f"for {patience:.0f} s (evaluated epochs {sorted(done) or 'none'} of {last_epoch}); "
                "the evaluator must see the chief's model_dir (the chief's host, or a shared disk)")
        time.sleep(poll_seconds)
    writer.close()
    return sorted(results, key=lambda r: r["epoch"])
