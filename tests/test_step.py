"""The training step on 2 workers: the main job's holds no host call of ours and one
collective; a user's step whose logs travel with its gradients trains as plain Keras."""

import json
import os
import re

import numpy as np
import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_single

ROOT = os.path.dirname(os.path.dirname(__file__))
WORKER = os.path.join(ROOT, "tests", "workers", "step_ops.py")
DISTILLER = os.path.join(ROOT, "tests", "workers", "distiller.py")
HOST_CALLS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")
# The ops that wait for another worker: reductions, gathers, broadcasts.
COLLECTIVES = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveGather", "CollectiveGatherV2",
               "CollectiveBcastSend", "CollectiveBcastRecv", "CollectiveBcastSendV2", "CollectiveBcastRecvV2",
               "CollectiveAllToAllV2", "CollectiveAllToAllV3", "CollectiveReduceV3")

pytestmark = pytest.mark.multiworker


@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_the_step_calls_no_host_function_and_runs_one_collective(tmp_path, model):
    """With the main job's callbacks and metrics, a step's graph holds no host call, and one
    collective: the gradients and every logged value in one pack (`distrib_tf.keras.step_logs`).
    Before: two (the logs in a pack of their own); before that, two host marks around the
    all-reduce, one all-reduce per logged value, and for the CNN the synchronized
    BatchNormalization's per layer."""
    results = run_cluster([WORKER, model, tmp_path], spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=240)
    for result in results:
        assert result.returncode == 0, (result.task, result.output[-3000:])
    seen = [json.loads((tmp_path / f"worker_{i}.json").read_text()) for i in (0, 1)]
    for each in seen:
        ops = each["ops"]
        assert not {op: ops[op] for op in HOST_CALLS if op in ops}, ops
        assert {op: n for op, n in ops.items() if op in COLLECTIVES} == {"CollectiveReduceV2": 1}, ops
        assert ops.get("Timestamp") == 2, ops  # The step-timing clock, read twice.
    assert seen[0]["weights_sum"] == seen[1]["weights_sum"]  # They trained together.


def _result(output):
    return json.loads(re.search(r"^RESULT (\{.*\})$", output, re.M).group(1))


def test_keras_ios_distiller_whose_compute_loss_takes_no_training_trains_as_plain_keras(tmp_path):
    """keras.io's `Distiller` overrides `compute_loss` without `training`, which Keras then
    never passes it (`Trainer._compute_loss`); the step that carries the logs with the
    gradients passed it anyway: a TypeError on 2 workers, not on one (issue 60 item 2). Its
    fit (with validation) and evaluate on 2 workers match plain Keras in one process: the
    same iterations and History, the same weights to rounding of the all-reduce."""
    plain = run_single([DISTILLER, tmp_path / "plain", "plain"], env={"PYTHONPATH": ROOT})
    check_ok([plain])
    expected = _result(plain.output)
    results = check_ok(run_cluster([DISTILLER, tmp_path / "run", "run"], spec=local_spec(2),
                                   env={"PYTHONPATH": ROOT}, timeout=240))
    for result in results:
        seen = _result(result.output)
        assert seen["iterations"] == expected["iterations"] == 8
        assert sorted(seen["history"]) == sorted(expected["history"])
        for key, values in expected["history"].items():
            np.testing.assert_allclose(seen["history"][key], values, rtol=1e-5, atol=1e-7, err_msg=key)
        for key, value in expected["evaluate"].items():
            np.testing.assert_allclose(seen["evaluate"][key], value, rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(seen["weights"], expected["weights"], rtol=1e-5, atol=1e-7)
