"""Every worker ends with the same variables, all of them: a plain BatchNormalization's moving
statistics and a user's variable assigned in `call` are the mean over the replicas
(`distrib_tf.keras.replica_state`), on a real 2-worker cluster."""

import os
import sys

import numpy as np
import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster

ROOT = os.path.dirname(os.path.dirname(__file__))
WORKER = os.path.join(ROOT, "tests", "workers", "moving_stats.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import moving_stats  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = pytest.mark.multiworker


def expected_state(replicas: int = 2):
    """What the mean over the replicas is, in float64: replica r of a step takes slice r of
    the global batch (the run's order; `shuffle=False`: the rows in order)."""
    x = moving_stats.make_data()[0].astype("float64")
    batch, momentum = moving_stats.GLOBAL_BATCH, moving_stats.MOMENTUM
    share = batch // replicas
    mean, variance, own = np.zeros(3), np.ones(3), np.zeros(3)
    for _ in range(moving_stats.EPOCHS):
        for start in range(0, moving_stats.ROWS, batch):
            parts = [x[start + r * share:start + (r + 1) * share] for r in range(replicas)]
            mean = momentum * mean + (1 - momentum) * np.mean([p.mean(axis=(0, 1)) for p in parts], axis=0)
            variance = momentum * variance + (1 - momentum) * np.mean([p.var(axis=(0, 1)) for p in parts], axis=0)
            own = momentum * own + (1 - momentum) * parts[0].mean(axis=(0, 1))  # The chief's shard alone.
    return {"moving_mean": mean, "moving_variance": variance, "last": x[-batch:].mean(axis=(0, 1)), "own": own}


def test_every_worker_ends_with_every_variable_the_mean_over_the_replicas(tmp_path):
    check_ok(run_cluster([WORKER, tmp_path], spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=240))
    workers = [dict(np.load(tmp_path / f"worker_{i}.npz")) for i in (0, 1)]
    ours = {k: v for k, v in workers[0].items() if not k.startswith("plain/")}
    assert len(ours) == 9, list(ours)
    for name in workers[0]:  # Keras alone: each worker keeps its own shard's statistics.
        if name.startswith("plain/"):
            assert not np.array_equal(workers[0][name], workers[1][name]), name
    for name, value in ours.items():  # Under a Run: every variable bit for bit on both workers.
        np.testing.assert_array_equal(value, workers[1][name], err_msg=name)
    expected = expected_state()
    for name, value in ours.items():
        key = name.rsplit("/", 1)[1]
        if key in expected:
            np.testing.assert_allclose(value, expected[key], rtol=1e-5, err_msg=name)
    # The data makes the fault visible: one shard's statistics are far from the mean.
    assert np.max(np.abs(expected["own"] - expected["moving_mean"])) > 0.1
