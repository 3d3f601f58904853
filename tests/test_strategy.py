"""make_strategy on CPU: each kind, `auto` from TF_CONFIG, bad arguments. Real processes."""

import json
import os
import tempfile

import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_single

HERE = os.path.dirname(__file__)
DESCRIBE = os.path.join(HERE, "workers", "describe.py")
TWO_RUNS = os.path.join(HERE, "workers", "two_runs.py")
ENV = {"PYTHONPATH": os.path.dirname(HERE)}


def describe(**kwargs):
    result = run_single([DESCRIBE, json.dumps(kwargs)], env=ENV)
    check_ok([result])
    return json.loads(result.output.strip().splitlines()[-1])


def describe_error(env=None, **kwargs):
    result = run_single([DESCRIBE, json.dumps(kwargs)], env={**ENV, **(env or {})}, timeout=60)
    assert result.returncode != 0, result.output
    return result.output


def test_auto_without_tf_config_is_one_device():
    built = describe()
    assert built["class"] == "OneDeviceStrategy" and built["replicas"] == 1
    assert built["devices"][0].endswith("CPU:0")


def test_mirrored_over_logical_cpus():
    built = describe(strategy="mirrored", cpu_replicas=2)
    assert built["class"] == "MirroredStrategy" and built["replicas"] == 2
    assert [d[-5:] for d in built["devices"]] == ["CPU:0", "CPU:1"]
    assert built["line"].startswith("MirroredStrategy: 2 replica(s)")


def test_auto_with_cpu_replicas_is_mirrored():
    assert describe(cpu_replicas=3)["replicas"] == 3


def test_explicit_kind_wins_over_a_one_task_tf_config():
    spec = local_spec(1).with_free_ports()
    single = run_single([DESCRIBE, json.dumps({"strategy": "mirrored", "cpu_replicas": 2})],
                        env={**ENV, "TF_CONFIG": spec.tf_config(spec.tasks[0])})
    check_ok([single])
    assert json.loads(single.output.strip().splitlines()[-1])["class"] == "MirroredStrategy"


def test_local_kind_for_a_task_of_several_is_refused():
    spec = local_spec(2).with_free_ports()
    single = run_single([DESCRIBE, json.dumps({"strategy": "one_device"})],
                        env={**ENV, "TF_CONFIG": spec.tf_config(spec.tasks[1])})
    assert single.returncode != 0
    assert ("ValueError: Invalid value for argument `strategy`. Received: strategy='one_device' while "
            "TF_CONFIG names 2 training tasks (this is worker:1).") in single.output


@pytest.mark.multiworker
def test_auto_from_tf_config_is_multi_worker():
    results = check_ok(run_cluster([DESCRIBE, json.dumps({"communication": "ring", "collective_timeout": 30})],
                                   spec=local_spec(2), env=ENV, timeout=120))
    lines = [json.loads(r.output.strip().splitlines()[-1])["line"] for r in results]
    for index, line in enumerate(lines):
        assert line.startswith("MultiWorkerMirroredStrategy: 2 replica(s) on 2 worker(s)"), line
        assert f"this is worker:{index}, communication=RING" in line


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "tpu"}, r"Invalid value for argument `strategy`\. Received: strategy='tpu'\. "
                      r"Expected one of 'auto', 'one_device', 'mirrored', 'multi_worker'"),
    ({"communication": "mpi"}, r"Received: communication='mpi'"),
    ({"cpu_replicas": 0}, r"Received: cpu_replicas=0\. Expected a positive integer or None"),
    ({"collective_timeout": -1}, r"Received: collective_timeout=-1"),
    ({"bytes_per_pack": -5}, r"Received: bytes_per_pack=-5"),
    ({"strategy": "multi_worker"}, r"Received: strategy='multi_worker' with no TF_CONFIG set"),
    ({"strategy": "mirrored", "cpu_replicas": 2, "start_runtime_first": True},
     r"make_strategy\(\) must be called before TensorFlow runs any operation"),
])
def test_bad_arguments(kwargs, message):
    import re  # pylint: disable=import-outside-toplevel

    assert re.search(message, describe_error(**kwargs))


def test_bad_tf_config_never_reaches_tensorflow():
    tf_config = '{"cluster": {"worker": ["127.0.0.1"]}, "task": {"type": "worker", "index": 0}}'
    output = describe_error(env={"TF_CONFIG": tf_config})
    assert "ClusterSpecError: Invalid value for `cluster.worker[0]` in TF_CONFIG. Received: '127.0.0.1'" in output


def test_a_keras_that_moved_its_private_modules_degrades_and_does_not_break():
    """An untested Keras whose private modules moved: `import distrib_tf` works, one warning,
    `fit` with the per-step callbacks trains, periodic sync says it is unavailable."""
    result = run_single([os.path.join(HERE, "workers", "moved_keras.py")], env=ENV)
    check_ok([result])
    seen = json.loads(result.output.strip().splitlines()[-1])
    assert len(seen["loss"]) == 1 and seen["loss"][0] > 0
    assert len(seen["warnings"]) == 1 and "Keras 3.99.0 is not a version distrib_tf was tested with" in \
        seen["warnings"][0], seen["warnings"]
    assert seen["periodic_sync"].startswith("Keras 3.99.0 is not a version distrib_tf was tested with"), seen


def test_a_second_mirrored_strategy_in_one_process_all_reduces():
    """TensorFlow starts every MirroredStrategy's collective keys at one place: in a process
    that made one before (a notebook cell run again), the second's first all-reduce of another
    dtype fails. make_strategy gives each strategy keys of its own: two runs, one after the
    other in one process, both train (the second failed at its first epoch's end)."""
    upstream = run_single([TWO_RUNS, "tensorflow"], env=ENV)
    check_ok([upstream])
    error = json.loads(upstream.output.strip().splitlines()[-1])["error"]
    assert "Collective instance" in error and "data_type 1 but got type 0 and data_type 2" in error, error
    with tempfile.TemporaryDirectory() as directory:
        ours = run_single([TWO_RUNS, "runs", directory], env=ENV)
    check_ok([ours])
    losses = json.loads(ours.output.strip().splitlines()[-1])["losses"]
    assert len(losses) == 2 and all(len(loss) == 2 for loss in losses), losses
