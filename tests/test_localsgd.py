"""Periodic averaging (local SGD) on two real workers: equal after each sync, apart between."""

import json
import os

import numpy as np
import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "workers", "local_sgd.py")
ENV = {"PYTHONPATH": os.path.dirname(HERE)}

pytestmark = pytest.mark.multiworker


def _run(tmp_path, sync, optimizer):
    out = tmp_path / f"{sync.replace(':', '_')}_{optimizer}"
    check_ok(run_cluster([SCRIPT, out, sync, optimizer], spec=local_spec(2), env=ENV, timeout=180))
    records = []
    for task in ("worker_0", "worker_1"):
        with open(out / f"{task}.json") as f:
            records.append(json.load(f))
    assert records[0]["pid"] != records[1]["pid"]
    return records


def test_workers_hold_identical_weights_after_each_sync_and_differ_between(tmp_path):
    chief, other = _run(tmp_path, "every:4", "adam")
    # At fit's start, then after steps 4, 8 and 12 (the last step: no extra sync at the end).
    assert len(chief["syncs"]) == len(other["syncs"]) == 4
    for mine, theirs in zip(chief["syncs"], other["syncs"]):
        assert mine["after"] == theirs["after"]
    # Each worker trained on its own shard in between: the weights had drifted apart.
    assert all(mine["before"] != theirs["before"] for mine, theirs in zip(chief["syncs"][1:], other["syncs"][1:]))
    for a, b in zip(chief["weights"], other["weights"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_every_step_averaging_equals_synchronous_training_for_linear_optimizers(tmp_path, optimizer):
    """SGD's update, with or without momentum, is linear in the gradient: the mean of the
    replicas' updates is the update of the mean gradient. (Adam's is not: it squares each
    replica's own gradient.) The trainable weights are compared: with an unsynchronized
    BatchNormalization, synchronous training keeps one replica's moving statistics where
    averaging keeps the mean of all replicas'."""
    synchronous = _run(tmp_path, "step", optimizer)[0]["trainable"]
    averaged = _run(tmp_path, "every:1", optimizer)[0]["trainable"]
    for a, b in zip(synchronous, averaged):  # Within 1e-5 of each weight's scale (float32 rounding).
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), (np.max(np.abs(a - b)), np.max(np.abs(a)))


def test_every_step_averaging_differs_from_synchronous_training_with_adam(tmp_path):
    synchronous = _run(tmp_path, "step", "adam")[0]["trainable"]
    averaged = _run(tmp_path, "every:1", "adam")[0]["trainable"]
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(synchronous, averaged)) > 1e-4
