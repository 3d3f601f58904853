import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cluster_runner import QUIET_TF  # noqa: E402  pylint: disable=wrong-import-position

# Every worker prints its lines (its epochs, its final weights' sha256) in the jobs the tests
# start: they compare what separate processes say. The default, one process speaking, is
# tested with this removed (tests/test_launch.py).
os.environ["DISTRIB_TF_VERBOSE"] = "1"


def pytest_configure(config):
    """The tasks the tests start (through the launcher, or `cluster_runner`) fork from an
    interpreter that imported Keras and TensorFlow once per test process
    (`distrib_tf.launch.forkserver`): TensorFlow's start-up, about 10 s a task here, paid once.
    Started before the test modules are imported, so that the environments they build at
    import carry `DISTRIB_TF_FORKSERVER` too (`_forkserver_ready` waits for them);
    `DISTRIB_TF_FORKSERVER=` (empty) starts every task as a new interpreter instead."""
    from distrib_tf.launch import forkserver  # pylint: disable=import-outside-toplevel

    config.forkservers = {}
    if forkserver.FORKSERVER_ENV in os.environ or getattr(config.option, "numprocesses", None) and not hasattr(
            config, "workerinput"):  # Set by the caller (theirs, or none); or xdist's controller, which runs no test.
        return
    # TensorFlow's C++ log level is read at import: one server for the tasks that leave it as
    # the tests do, one for those at the quiet launcher's and `cluster_runner`'s level.
    directory = tempfile.mkdtemp(prefix="distrib_tf_forkserver.")
    for level in dict.fromkeys((os.environ.get("TF_CPP_MIN_LOG_LEVEL"), QUIET_TF["TF_CPP_MIN_LOG_LEVEL"])):
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        path = os.path.join(directory, f"level-{level or 'unset'}")
        with open(f"{path}.log", "wb") as log:
            config.forkservers[path] = subprocess.Popen(
                [sys.executable, "-m", "distrib_tf.launch.forkserver", path], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env if level is None else {**env, "TF_CPP_MIN_LOG_LEVEL": level})
    os.environ[forkserver.FORKSERVER_ENV] = ":".join(config.forkservers)


def pytest_unconfigure(config):
    from distrib_tf.launch import forkserver  # pylint: disable=import-outside-toplevel

    servers = getattr(config, "forkservers", {})
    if servers:
        os.environ.pop(forkserver.FORKSERVER_ENV, None)
    for server in servers.values():
        server.terminate()
        server.wait(timeout=30)
    if servers:  # Their one folder.
        shutil.rmtree(os.path.dirname(next(iter(servers))), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _forkserver_ready(pytestconfig):
    """The servers listening (or gone: their tasks start as new interpreters) before a test runs."""
    servers = pytestconfig.forkservers
    deadline = time.monotonic() + 300
    while not all(os.path.exists(p) or s.poll() is not None for p, s in servers.items()) and \
            time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="session")
def shapes_on_disk(tmp_path_factory):
    """`--dataset=` for a streamed copy of `shapes`: ArrayRecord shards read by index."""
    from distrib_tf.data import prepare  # pylint: disable=import-outside-toplevel  (TensorFlow)

    return prepare.prepare("shapes", str(tmp_path_factory.mktemp("shapes_on_disk")), num_shards=4).name


@pytest.fixture(autouse=True)
def _no_run_left_live():
    """A test that made a `distrib_tf.Run` in this process and failed before ending it does
    not leave it live for the next test (one Run at a time in a process)."""
    yield
    routing = sys.modules.get("distrib_tf.run.routing")
    if routing is not None and routing.live() is not None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        tf.distribute.experimental_set_strategy(None)
        routing.deactivate(routing.live())
