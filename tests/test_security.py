"""A local cluster is not reachable from the network: tried from a namespace of our own."""

import os
import re
import signal
import sys

import pytest

import netns
from cluster_runner import QUIET_TF
from cluster_runner import start_and_wait_for

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}


def _serve(out, *options):
    proc, text = start_and_wait_for(
        [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
         "--grace_period=2", *options, "--", sys.executable, os.path.join(ROOT, "tests", "workers", "serve.py")],
        out, marker="] serving", count=2, env=ENV)
    return proc, [int(p) for p in re.findall(r"at 127\.0\.0\.1:(\d+)", text)], text


@pytest.mark.multiworker
@pytest.mark.parametrize("private", [True, False])
def test_local_cluster_is_unreachable_from_the_network(tmp_path, private):
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    with netns.outside_host() as (namespace, host_address, _), open(tmp_path / "out", "w+") as out:
        proc, ports, text = _serve(out, *([] if private else ["--no_private"]))
        try:
            assert len(ports) == 2
            reachable = [netns.can_connect(namespace, host_address, port) for port in ports]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    if private:
        assert "private network namespace" in text
        assert reachable == [False, False]
    else:
        assert "WARNING: --no_private: TensorFlow's gRPC servers listen on every interface" in text
        assert reachable == [True, True]  # The probe does see an exposed worker.
