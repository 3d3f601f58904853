"""Every training run of `make bench-scaling`: the main job, writing every step's times.

    STEP_TIMES_OUT=FILE.json step_times.py [--off=NAMES] [distrib_tf.train flags]

The main job as `python -m distrib_tf.train` runs it (`--off`: with `overhead.py`'s additions
NAMES switched off), with one addition on the host after each training step, the same in every
case `scaling.py` compares (one worker, two side by side, two together): a read of the seconds
the step waited on the gradient all-reduce, which `distrib_tf.keras.progress` already sums
inside the step (`local_sgd.time_all_reduce`; 0 for one worker). Writes `[[epoch, wall seconds,
waited seconds], ...]`, one row a step. With both workers' rows, `scaling.py` splits a step's
wait: the worker that reaches the all-reduce last waits only for the collective itself; what
the other waits beyond that is the time it waited for its peer.
"""

import json
import os
import sys
import time

from distrib_tf.keras import progress
from distrib_tf.train.cli import run

rows = []
_BEFORE = "_step_times_before"  # The wait summed so far, as this file last read it.


def _record(original):
    def on_train_batch_end(self, batch, logs=None):
        wall = time.perf_counter() - self._begin  # pylint: disable=protected-access
        total = float(self._waited.read_value())  # pylint: disable=protected-access
        rows.append([self._epoch, wall, total - self.__dict__.get(_BEFORE, 0.0)])  # pylint: disable=protected-access
        self.__dict__[_BEFORE] = total
        original(self, batch, logs)
    return on_train_batch_end


def _emptied(original):
    def exchange_times(self):  # Progress empties the sum when it exchanges the step times.
        original(self)
        self.__dict__[_BEFORE] = 0.0
    return exchange_times


def _write(original):
    def on_train_end(self, logs=None):
        original(self, logs)
        with open(os.environ["STEP_TIMES_OUT"], "w") as f:
            json.dump(rows, f)
    return on_train_end


progress.Progress.on_train_batch_end = _record(progress.Progress.on_train_batch_end)
progress.Progress._exchange_times = _emptied(progress.Progress._exchange_times)  # pylint: disable=protected-access
progress.Progress.on_train_end = _write(progress.Progress.on_train_end)

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1].startswith("--off="):
        from overhead import switch_off  # pylint: disable=import-outside-toplevel
        switch_off(sys.argv.pop(1).removeprefix("--off=").split(","))
    run()
