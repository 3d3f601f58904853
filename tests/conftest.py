import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Every worker prints its lines (its epochs, its final weights' sha256) in the jobs the tests
# start: they compare what separate processes say. The default, one process speaking, is
# tested with this removed (tests/test_launch.py).
os.environ["DISTRIB_TF_VERBOSE"] = "1"


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
