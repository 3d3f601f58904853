import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def shapes_on_disk(tmp_path_factory):
    """`--dataset=` for a streamed copy of `shapes`: ArrayRecord shards read by index."""
    from distrib_tf.data import prepare  # pylint: disable=import-outside-toplevel  (TensorFlow)

    return prepare.prepare("shapes", str(tmp_path_factory.mktemp("shapes_on_disk")), num_shards=4).name
