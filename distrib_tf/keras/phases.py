"""Every worker enters a phase together, so that a collective timeout means a dead peer.

`make_strategy(timeout_seconds=S)` fails an all-reduce that has waited S seconds for a
peer. A peer that is alive but still busy elsewhere (tracing a new step function, which
takes minutes for a large model; restoring its backup; the chief writing the model)
trips it as a dead one would, and the job restarts for nothing. So before the first
collective of each phase every worker meets at a barrier of TensorFlow's coordination
service, whose own deadline (`BARRIER_SECONDS`) is generous: a worker that dies before
it fails the barrier at once (the service stops hearing its heartbeats), a slow one is
waited for. The collective timeout then starts once every worker is at the collective.

`enter(strategy, name)` is that barrier; `distrib_tf.keras.compat` (fix 9) traces every
Keras step function before its first run and then calls it, so tracing, which may take
any time, happens before the barrier. What a first run still does before its first
collective (TensorFlow's graph optimizations) happens within the timeout on every worker
alike.
"""

import collections
import os

import tensorflow as tf
from tensorflow.python.eager import context  # The coordination service's barrier.

BARRIER_ENV = "DISTRIB_TF_BARRIER_SECONDS"
BARRIER_SECONDS = 3600.0  # Default deadline of a phase barrier.
_entered = collections.Counter()  # Each barrier's id is new: its name and how often it came.


def is_multi_worker(strategy) -> bool:
    """Whether `strategy`'s collectives span processes (a coordination service runs)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode())  # pylint: disable=protected-access


def enter(strategy, name: str, timeout_seconds: float | None = None) -> None:
    """Waits until every worker of `strategy` has called `enter` with this `name` as often.

    Does nothing under a strategy of one process. Every worker must call it at the same
    points, in the same order.
    """
    if not is_multi_worker(strategy):
        return
    _entered[name] += 1
    if timeout_seconds is None:
        timeout_seconds = float(os.environ.get(BARRIER_ENV, BARRIER_SECONDS))
    context.context().wait_at_barrier(f"distrib_tf/{name}/{_entered[name]}", int(timeout_seconds * 1000))
