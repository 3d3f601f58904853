"""Builds a strategy from argv (JSON kwargs) and prints what was built as JSON."""

import json
import sys

import distrib_tf


def main():
    kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if kwargs.pop("start_runtime_first", False):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.constant(1.0) + 1.0
    strategy = distrib_tf.make_strategy(**kwargs)
    print(json.dumps({
        "class": type(strategy).__name__,
        "line": distrib_tf.describe_strategy(strategy),
        "replicas": strategy.num_replicas_in_sync,
        "devices": list(strategy.extended.worker_devices),
    }))


if __name__ == "__main__":
    main()
