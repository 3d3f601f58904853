"""A local cluster is not reachable from the network: tried from a namespace of our own."""

import os
import re
import signal
import subprocess
import sys
import time

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
        proc, ports, text = _serve(out, *([] if private else ["--network=host"]))
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
        assert "WARNING: --network=host: TensorFlow's gRPC servers listen on every interface" in text
        assert reachable == [True, True]  # The probe does see an exposed worker.


@pytest.mark.parametrize("network", ["private", pytest.param("host", marks=pytest.mark.slow)])
def test_outbound_access_is_the_network_flags_choice(tmp_path, network):
    """A task reads a file from a server outside (in a namespace of the test's own): from the
    private namespace it cannot, and the launcher names `--network=host`; with it, it can."""
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    (tmp_path / "probe.txt").write_text("outside says hello")
    with netns.outside_host() as (namespace, _, outside_address):
        server = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-m", "http.server", "8765",
                                   "--bind", outside_address, "--directory", str(tmp_path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not netns.can_connect(namespace, outside_address, 8765) and time.monotonic() < deadline:
                time.sleep(0.2)
            fetch = (f"import urllib.request; print(urllib.request.urlopen("
                     f"'http://{outside_address}:8765/probe.txt', timeout=10).read().decode())")
            result = subprocess.run(
                [sys.executable, "-m", "distrib_tf.launch", f"--cluster_spec={ROOT}/cluster_specs/local_2workers.json",
                 f"--network={network}", "--", sys.executable, "-c", fetch],
                env=ENV, capture_output=True, text=True, timeout=120)
        finally:
            server.kill()
            server.wait()
    if network == "host":
        assert result.returncode == 0, result.stdout[-3000:]
        assert result.stdout.count("outside says hello") == 2
    else:
        assert result.returncode == 1, result.stdout[-3000:]
        assert "Network is unreachable" in result.stdout  # The fault happened: no route out.
        assert ("hint: the tasks run in a private network namespace with no network access" in result.stdout
                and "needs --network=host" in result.stdout), result.stdout[-3000:]
