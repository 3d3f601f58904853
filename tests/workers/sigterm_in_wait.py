"""A worker of several, SIGTERMed while its main thread waits in a TensorFlow C++ call that
then fails: the way a barrier or a collective ends when a preempted peer leaves first.

    TF_CONFIG=... python tests/workers/sigterm_in_wait.py

Inside `sigterm.saved(5)` (the state saved, as after training) each worker's main thread
waits for a key that never comes (the coordination service's `get_config_key_value`, 1.5 s
deadline); the SIGTERM comes 0.5 s into it, from a thread, as the scheduler's would. Exit 75
with the preemption line is right; an exception that reaches this script (the handler's
`Preempted` raised inside TensorFlow's error, or pybind11's `MISMATCH of original and
normalized active exception types`) is printed and exits 1.
"""

import os
import signal
import sys
import threading

import tensorflow as tf
from tensorflow.python.eager import context

from distrib_tf import make_strategy
from distrib_tf.keras import sigterm

strategy = make_strategy()
sigterm.install()
sigterm.reclaim()
sigterm.watch_peers(strategy)
resolver = strategy.cluster_resolver
task = f"{resolver.task_type}:{resolver.task_id}"
sigterm.set_task(task, leader=task == "worker:0")
with sigterm.saved(5):
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        context.context().get_config_key_value("sigterm_in_wait/never", timeout_in_ms=1500)
    except BaseException as e:  # pylint: disable=broad-except  (what the test looks for)
        print(f"{task}: raised into the wait: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        sys.exit(1)
print(f"{task}: the wait ended without an error", flush=True)
tf.print("unreachable")
sys.exit(3)
