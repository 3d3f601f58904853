"""The main job's training step on 2 workers: no host call of ours, one collective."""

import json
import os

import pytest

from cluster_runner import local_spec
from cluster_runner import run_cluster

ROOT = os.path.dirname(os.path.dirname(__file__))
WORKER = os.path.join(ROOT, "tests", "workers", "step_ops.py")
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
