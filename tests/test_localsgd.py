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


def _run(tmp_path, sync, optimizer, dtype="float32"):
    out = tmp_path / f"{sync.replace(':', '_')}_{optimizer}"
    check_ok(run_cluster([SCRIPT, out, sync, optimizer, dtype], spec=local_spec(2), env=ENV, timeout=180))
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


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("momentum", marks=pytest.mark.slow)])  # make soak.
def test_every_step_averaging_equals_synchronous_training_for_linear_optimizers(tmp_path, optimizer):
    """SGD's update, with or without momentum, is linear in the gradient: the mean of the
    replicas' updates is the update of the mean gradient. (Adam's is not: it squares each
    replica's own gradient.) The trainable weights are compared: with an unsynchronized
    BatchNormalization, synchronous training keeps one replica's moving statistics where
    averaging keeps the mean of all replicas'.

    The two sides sum the same terms in other orders, so they agree to rounding, which in
    float32 (unit roundoff 6e-8, amplified by 12 steps of momentum and of the network's
    own dynamics) reached 1.9e-7 of the largest weight, in one run of many. In float64 the
    unit roundoff is 1.1e-16: the same amplification stays near 1e-14, and 1e-10 leaves
    four orders of margin while a real difference (a skipped average, one replica's update
    kept) is 1e-3 or more. So the property is tested in float64."""
    synchronous = _run(tmp_path, "step", optimizer, "float64")[0]["trainable"]
    averaged = _run(tmp_path, "every:1", optimizer, "float64")[0]["trainable"]
    for a, b in zip(synchronous, averaged):
        a, b = np.asarray(a), np.asarray(b)
        difference = np.max(np.abs(a - b)) / np.max(np.abs(a))
        print(f"{optimizer}: every-step averaging against synchronous, relative {difference:.2g}")
        assert difference <= 1e-10, difference


@pytest.mark.slow  # 24 s: make soak (the linear optimizers' equality runs in make test).
def test_every_step_averaging_differs_from_synchronous_training_with_adam(tmp_path):
    synchronous = _run(tmp_path, "step", "adam")[0]["trainable"]
    averaged = _run(tmp_path, "every:1", "adam")[0]["trainable"]
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(synchronous, averaged)) > 1e-4


def test_a_float16_all_reduce_is_refused_for_a_loss_scale_optimizer():
    import keras  # pylint: disable=import-outside-toplevel

    from distrib_tf.keras import local_sgd  # pylint: disable=import-outside-toplevel

    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"Received: dtype='float16' for a LossScaleOptimizer. Expected 'bfloat16'"):
        local_sgd.compress_gradients(optimizer, "float16")
    local_sgd.compress_gradients(optimizer, "bfloat16")  # No overflow in bfloat16's range.
    local_sgd.compress_gradients(optimizer, "float32")
