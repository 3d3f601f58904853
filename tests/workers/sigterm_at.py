"""The main job, preempted in one phase: on entering PHASE a task asks the test for a
SIGTERM to the launcher (as a scheduler would send it), by writing REQUEST_FILE, and waits
for it there, as a task busy in that phase would.

    python tests/workers/sigterm_at.py PHASE REQUEST_FILE [main job flags...]

PHASE: `start-up` (the job's checks and its strategy), `validation` (the last epoch's),
`final-evaluate`, `export` (the chief's model files). It hooks only names that were there
before SIGTERM outside training batches was handled, so it runs on that code too.
"""

import os
import sys
import time

import keras

from distrib_tf.train import cli
from distrib_tf.train import job
from distrib_tf.train import serving

PHASE, REQUEST_FILE = sys.argv[1:3]
EPOCHS = 2  # The test's --epochs: the validations are on_test_begin calls 1 and 2, then the final evaluate.


def _preempt_here():
    with open(REQUEST_FILE, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    print(f"{PHASE}: asked for SIGTERM", flush=True)
    time.sleep(60)  # What the task does when SIGTERM comes: here, a long phase.
    print(f"{PHASE}: no SIGTERM handled in 60 s", flush=True)


def _hook(owner, name, call_number, *, after=False):
    """Preempts in the `call_number`th call of `owner.name`, before it runs or just after."""
    original, calls = getattr(owner, name), [0]

    def hooked(*args, **kwargs):
        if isinstance(owner, type) and type(args[0]) is not owner:  # Not a subclass's (the run's own lists).
            return original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == call_number and not after:
            _preempt_here()
        result = original(*args, **kwargs)
        if calls[0] == call_number and after:
            _preempt_here()
        return result

    setattr(owner, name, hooked)


if PHASE == "start-up":
    _hook(job, "prepare_job", 1)
elif PHASE == "validation":
    _hook(keras.callbacks.CallbackList, "on_test_begin", EPOCHS, after=True)
elif PHASE == "final-evaluate":
    _hook(keras.callbacks.CallbackList, "on_test_begin", EPOCHS + 1, after=True)
elif PHASE == "export":
    _hook(serving, "export_model", 1)
else:
    sys.exit(f"unknown phase {PHASE!r}")

if __name__ == "__main__":
    sys.argv[1:3] = []
    cli.define_flags()
    from absl import app  # pylint: disable=import-outside-toplevel

    app.run(cli.main, flags_parser=cli._parse_flags)  # pylint: disable=protected-access
