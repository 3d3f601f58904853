"""A child that dies with the process that started it, asked for through the environment.

A parent that starts the main job as a child (Ray's worker, `distrib_tf.deploy.ray_train`)
sets `DISTRIB_TF_PARENT_PID` to its own pid; the child, first thing, asks Linux to send it
SIGTERM when that parent dies (`PR_SET_PDEATHSIG`), so it backs up and leaves instead of
running on beside the parent's replacement. Done in the child itself, not in a
`preexec_fn`, which the Python documentation warns can deadlock in a threaded parent.

No TensorFlow here.
"""

import ctypes
import os
import signal

PARENT_ENV = "DISTRIB_TF_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM to this process when the parent named by `DISTRIB_TF_PARENT_PID` dies (now, if
    it is gone already). Does nothing without the variable, or off Linux."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not parent.isdigit():
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # It died before the request: as if it had just now.
        os.kill(os.getpid(), signal.SIGTERM)
