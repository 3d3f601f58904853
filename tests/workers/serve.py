"""Builds the multi-worker strategy (its gRPC server starts), says so, then waits."""

import time

import distrib_tf

distrib_tf.make_strategy()
print("serving", flush=True)
time.sleep(120)
