"""Cluster specs and TF_CONFIG: validation, free ports, local tasks. No TensorFlow."""

import json
import os
import socket
import subprocess
import sys

import pytest

from distrib_tf.cluster import ClusterSpec
from distrib_tf.cluster import ClusterSpecError
from distrib_tf.cluster import Task
from distrib_tf.cluster import load_tf_config
from distrib_tf.cluster import parse_task

# The corpus of malformed input, kept as data: tests/bad_inputs.json.
with open(os.path.join(os.path.dirname(__file__), "bad_inputs.json"), encoding="utf-8") as _f:
    CORPUS = json.load(_f)
BAD_SPECS = [(case["text"], case["error"]) for case in CORPUS["specs"]]


@pytest.mark.parametrize("text, message", BAD_SPECS)
def test_bad_spec_file_gives_one_line(tmp_path, text, message):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(ClusterSpecError, match=message) as error:
        ClusterSpec.from_file(path)
    assert "\n" not in str(error.value)


def test_unreadable_spec_names_the_file(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ClusterSpecError, match=r"Cannot read cluster spec .*missing\.json: No such file"):
        ClusterSpec.from_file(missing)
    with pytest.raises(ClusterSpecError, match=r"Cannot read cluster spec .*: Is a directory"):
        ClusterSpec.from_file(tmp_path)


GOOD = {"cluster": {"chief": ["127.0.0.1:0"], "worker": ["127.0.0.1:0", "127.0.0.1:0"]}}

BAD_TF_CONFIGS = [(case["text"], case["error"]) for case in CORPUS["tf_configs"]]


@pytest.mark.parametrize("text, message", BAD_TF_CONFIGS)
def test_bad_tf_config_gives_one_line(text, message):
    with pytest.raises(ClusterSpecError, match=message):
        load_tf_config({"TF_CONFIG": text})


def test_tf_config_round_trip():
    spec = ClusterSpec.from_dict(GOOD).with_free_ports()
    for task in spec.tasks:
        loaded_spec, loaded_task = load_tf_config({"TF_CONFIG": spec.tf_config(task)})
        assert loaded_task == task
        assert loaded_spec.jobs == spec.jobs


def test_tf_config_absent_or_empty_means_single_worker():
    assert load_tf_config({}) is None
    assert load_tf_config({"TF_CONFIG": ""}) is None
    assert load_tf_config({"TF_CONFIG": "{}"}) is None


def test_tasks_in_order_and_counts():
    spec = ClusterSpec.from_dict(
        {"cluster": {"evaluator": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"], "chief": ["127.0.0.1:0"]}}
    )
    assert [str(t) for t in spec.tasks] == ["chief:0", "worker:0", "evaluator:0"]
    assert spec.num_workers == 2


def test_free_ports_are_distinct_and_bindable():
    spec = ClusterSpec.from_file("cluster_specs/local_4workers.json").with_free_ports()
    ports = [int(a.rsplit(":", 1)[1]) for a in spec.jobs["worker"]]
    assert len(set(ports)) == 4 and 0 not in ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_tf_config_refuses_port_zero():
    spec = ClusterSpec.from_dict(GOOD)
    with pytest.raises(ClusterSpecError, match=r"call `with_free_ports\(\)` before `tf_config\(\)`"):
        spec.tf_config(Task("worker", 0))


def test_port_zero_on_another_host_is_refused():
    spec = ClusterSpec.from_dict({"cluster": {"worker": ["127.0.0.1:0", "192.0.2.7:0"]}}, source="x.json")
    message = r"`cluster\.worker\[1\]` in x\.json\. Received: '192\.0\.2\.7:0'\. Expected a fixed port"
    with pytest.raises(ClusterSpecError, match=message):
        spec.with_free_ports()


def test_local_tasks():
    spec = ClusterSpec.from_dict(
        {"cluster": {"worker": ["127.0.0.1:2222", "localhost:2223", "192.0.2.1:2222"]}}
    )
    assert [str(t) for t in spec.local_tasks()] == ["worker:0", "worker:1"]


def test_parse_task():
    assert parse_task("worker:3") == Task("worker", 3)
    for text in ["worker", "worker:x", "ps:0", "worker:-1", ""]:
        with pytest.raises(ClusterSpecError,
                           match=r"Invalid value for `task` in --task\. Received: .*Expected TYPE:INDEX"):
            parse_task(text)


def test_shipped_specs_validate():
    import glob  # pylint: disable=import-outside-toplevel

    paths = sorted(glob.glob("cluster_specs/*.json"))
    assert len(paths) >= 5
    for path in paths:
        assert ClusterSpec.from_file(path).num_workers >= 1


def test_cluster_module_imports_no_tensorflow():
    code = "import sys, distrib_tf, distrib_tf.cluster; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
