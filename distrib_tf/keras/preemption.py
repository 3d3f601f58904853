"""Preemption that loses no step: SIGTERM, one agreed step, a backup on every worker, exit 75.

Clusters take machines back with a SIGTERM first (Slurm before a preemption or the end of
a time limit, Kubernetes before an eviction). `install_sigterm_handler()` makes SIGTERM
only record that it came. Between training batches, `SaveOnPreemption` then has every
worker agree on the next step through the coordination service, back it up and raise
`Preempted`; between preemptions it costs nothing but a flag read per step. Outside the
training batches (start-up, validation, a final evaluate, an export) nothing changes the
weights, so nothing needs agreeing: inside `saved(step)`, entered once every worker's
backup holds `step`, SIGTERM ends the task with 75 at once: one of several workers leaves
from the handler itself, which never raises into the wait the main thread is in (a
barrier or a collective whose peer just left: the exception raised into TensorFlow's C++
call came out as `RuntimeError: pybind11::error_already_set: MISMATCH ...`, exit 1); one
process raises `Preempted`. The main job then exits with
`distrib_tf.exit_codes.PREEMPTED` (75), which the launcher forwards; started again, the job resumes at
that step (`distrib_tf.keras.backup`): no step is lost.

Example, for a Keras user's own `fit`:

    >>> strategy = distrib_tf.make_strategy()
    >>> install_sigterm_handler()  # After the strategy: making one takes SIGTERM's handler.
    >>> backup = WorkerBackup(...)
    >>> model.fit(..., callbacks=[backup, SaveOnPreemption(backup)])
"""

import contextlib
import os
import signal
import sys
import threading
import time

import keras
import tensorflow as tf
from tensorflow.python.eager import context  # The coordination service's key-value store.

from distrib_tf import exit_codes
from distrib_tf.keras import backup

_requested = _installed = False
_saved: list = []  # Innermost last: the step every worker's backup holds (`saved()`).
GRACE_ENV = "DISTRIB_TF_GRACE_SECONDS"  # Set by `distrib_tf.launch` from its `--grace_period`.


class Preempted(Exception):
    """Every worker backed up `step` because one of them received SIGTERM.

    `step` is `None` when it came before training started: the backups are as they were."""

    def __init__(self, step: int | None):
        super().__init__(f"preempted: every worker backed up step {step}" if step is not None
                         else "preempted before training started: the backups are as they were")
        self.step = step

    def describe(self, task: str) -> str:
        """The one line a preempted task prints."""
        saved = ("the backups are as they were" if self.step is None
                 else f"backed up step {self.step} like every worker")
        return f"{task} preempted: {saved}; start the job again to resume there (exit code {exit_codes.PREEMPTED})"


STUCK_SECONDS = 3.0  # A SIGTERM inside `saved()` that the main thread has not acted on by then.
_task = "this task"
_leader = False
_leaving = False
LEADER_LEAVES_AFTER_SECONDS = 0.5  # The coordination service's host leaves last.


def set_task(task: str, *, leader: bool = False) -> None:
    """Names this worker in the line a preemption prints (`worker:1`); `leader`: it hosts the
    coordination service (the chief), and leaves a moment after the others."""
    global _task, _leader
    _task, _leader = task, leader


def leaving() -> None:
    """The main thread is leaving on a preemption: the watchdog has nothing left to do."""
    global _leaving
    _leaving = True


def _start_watchdog() -> None:
    """A SIGTERM wakes a thread (Python's wakeup fd is written by the C-level handler, even
    while the main thread waits inside TensorFlow); if the main thread, inside `saved()`, has
    not left within `STUCK_SECONDS`, it is stuck in a wait that a peer's departure will never
    end (a strategy waiting for a worker that was preempted during start-up, a barrier whose
    chief left), and the thread ends the task with 75: nothing there changes the backups."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # Not the main thread.
        os.close(read_end)
        os.close(write_end)
        return
    if previous != -1:  # Someone else's (an event loop): leave it theirs.
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return
    threading.Thread(target=_watch_for_stuck, args=(read_end,), name="distrib_tf-sigterm-watchdog",
                     daemon=True).start()


def _watch_for_stuck(read_end: int) -> None:
    while signal.SIGTERM not in os.read(read_end, 64):
        pass
    if _outside_default and not _saved and not _guards[0]:
        # The kernel may have handed the signal to another thread (TensorFlow's, or this one):
        # a main thread asleep in a C call (a script's time.sleep, a read) would then run the
        # handler, SIGTERM's default meaning, only once that call returns, minutes later.
        # Sent to the main thread, the signal ends the call and the handler runs at once.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    time.sleep(STUCK_SECONDS)
    if _saved and not _leaving:
        _leave(_saved[-1])


def _leave(step: int | None) -> None:
    """Ends this task with 75 at once: its backup holds `step`, like every worker's (once
    the background writer has put it on the disk)."""
    global _leaving
    _leaving = True
    _written()
    told_peers()
    print(Preempted(step).describe(_task), flush=True)
    sys.stderr.flush()
    if _leader:
        time.sleep(LEADER_LEAVES_AFTER_SECONDS)
    os._exit(exit_codes.PREEMPTED)


def install_sigterm_handler(*, outside_phases: str = "record") -> None:
    """SIGTERM then records that a preemption is coming, or raises inside `saved()`
    (main thread only); with `watch_peers`, it tells every other worker too.

    `outside_phases="default"`: outside `saved()` and `guarded()` (a user's script loading
    its data, or working on after `fit`) SIGTERM keeps its default meaning and ends the
    process. A handler already installed keeps its mode (the main job's records always).

    Making a `MultiWorkerMirroredStrategy` installs TensorFlow's own SIGTERM handler (the
    coordination service's preemption notifier, which does not stop the process): call
    this after it, or `reclaim_sigterm()` once it is made.
    """
    global _installed, _outside_default
    if not _installed:
        _start_watchdog()
        _outside_default = outside_phases == "default"
    _installed = True
    signal.signal(signal.SIGTERM, _record)


def reclaim_sigterm() -> None:
    """Takes SIGTERM back from TensorFlow's notifier, if `install_sigterm_handler()` was called."""
    if _installed:  # `signal.getsignal` cannot tell: it answers what Python last set.
        signal.signal(signal.SIGTERM, _record)


_outside_default = False
_guards = [0]  # Phases inside which a SIGTERM is a preemption to save (`guarded()`).


@contextlib.contextmanager
def guarded():
    """Inside (a `fit`: its callbacks save and stop), SIGTERM is a preemption to save,
    whatever `install_sigterm_handler`'s `outside_phases`."""
    _guards[0] += 1
    try:
        yield
    finally:
        _guards[0] -= 1


def _record(signum, frame):
    global _requested
    if _outside_default and not _saved and not _guards[0]:  # Not ours to save: as if never installed.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    first = not _requested
    _requested = True
    if first and _peers_key is not None:  # Every worker, in whatever phase it is, is told.
        _telling.append(threading.Thread(target=_set_once, args=(_peers_key, "sigterm"), daemon=True))
        _telling[-1].start()
    if _saved:
        if _peers_key is not None:  # Several workers: never raise into what the main thread waits in.
            _leave(_saved[-1])
        _written()
        raise Preempted(_saved[-1])  # One process: no peer's departure can end a wait under it.


def _written() -> None:
    """Waits for the backups in flight (`backup.WRITER`); a task whose backup could not be
    written did not save its state: it says so and exits 1, not 75."""
    try:
        backup.WRITER.wait()
    except Exception as e:  # pylint: disable=broad-except
        print(f"{_task}: preempted, but its backup was not written: {type(e).__name__}: {e}", flush=True)
        os._exit(exit_codes.FAILED)


_peers_key: str | None = None
_telling: list = []  # The thread naming PEERS_KEY, once a SIGTERM came.
PEERS_KEY = "distrib_tf/preempt/any"


def told_peers(timeout: float = 5.0) -> None:
    """Waits (at most `timeout` s) until the peers were told of this worker's SIGTERM: before a
    preempted worker leaves at once, its key must be in the coordination service."""
    for thread in _telling:
        thread.join(timeout)


def check(step: int | None) -> None:
    """Raises `Preempted(step)` if a SIGTERM came (this worker's, or a peer's through
    `watch_peers`): for a wait that a peer's departure ended with an error."""
    if _requested:
        raise Preempted(step)


def watch_peers(strategy) -> None:
    """Under several workers: a SIGTERM to any one of them reaches this one as its own.

    A worker's first SIGTERM names `PEERS_KEY` in the coordination service's key-value store;
    a thread on every worker waits on that key and sends its own process SIGTERM. So a
    SIGTERM outside the training batches (start-up, validation, the final evaluate, the
    export: `saved()`), which ends its worker at once, ends every worker with 75 instead of
    leaving the others to fail at their next collective; in the training batches the peers
    join the agreement on one step (`SaveOnPreemption`) as they would have anyway. Call it
    once, after `install_sigterm_handler()`; `stop_watching()` at the clean end.
    """
    global _peers_key
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if _peers_key is not None or sum(len(spec.get(kind, ())) for kind in ("chief", "worker")) < 2:
        return
    _peers_key = PEERS_KEY

    def wait():
        try:
            value = context.context().get_config_key_value(PEERS_KEY)  # Blocks until set.
        except Exception:  # pylint: disable=broad-except  (the service gone: nothing to hear)
            return
        if value == "sigterm" and not _requested:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="distrib_tf-peers-preemption", daemon=True).start()


def stop_watching() -> None:
    """The run ended: the peers' watch is released (a SIGTERM from now on concerns no peer)."""
    if _peers_key is not None:
        _set_once(_peers_key, _NONE)


@contextlib.contextmanager
def saved(step: int | None):
    """Inside, a SIGTERM ends the task with 75 at once (and on entry, if one came): one of
    several workers leaves from the signal handler, one process raises `Preempted(step)`.

    For the phases that change no weight: enter once every worker's backup holds `step`
    (`None`: before training, with the backups as they were) and keep inside only work
    that a restart can redo, whose files appear by a rename (the export). A worker still
    inside a collective there is not waited for: its backup holds `step` too.
    Without `install_sigterm_handler()` it does nothing.
    """
    _saved.append(step)
    try:
        if _requested:
            raise Preempted(step)
        yield
    finally:
        _saved.pop()


def requested() -> bool:
    """Whether a SIGTERM came: this worker's, or a peer's (`watch_peers`)."""
    return _requested


def request() -> None:
    """Asks for a preemption save at the next step, as SIGTERM does."""
    global _requested
    _requested = True


_fits = [0]  # Keras fits that a SaveOnPreemption watched, in this process.


def fits() -> int:
    """How many Keras fits a `SaveOnPreemption` watched in this process: a key per fit."""
    return _fits[0]


class SaveOnPreemption(keras.callbacks.Callback):
    """Saves and stops every worker at one step once any of them received SIGTERM.

    No collective per step: the first worker told names the step after the one it has
    finished in the coordination service's key-value store and waits until every worker
    has read it (a thread on each blocks on the key). Workers that all-reduce at every
    step (gradients, or Keras's metrics under periodic sync) are never a step apart, so
    none can have passed it. TensorFlow's `PreemptionCheckpointHandler` agrees the same
    way. In one process the flag alone decides.

    Args:
        worker_backup: the `distrib_tf.keras.backup.WorkerBackup` of this worker, which
            must come before this callback in `fit`'s list (it counts the steps).
        ack_timeout: seconds to wait for the other workers to read the step; by default a
            quarter of the seconds between SIGTERM and SIGKILL that the launcher gives its
            tasks (`DISTRIB_TF_GRACE_SECONDS`), else 120: the step and the backup must
            still fit in that grace after a worker that never answers.
    """

    def __init__(self, worker_backup, *, ack_timeout: float | None = None):
        super().__init__()
        if ack_timeout is None:
            grace = os.environ.get(GRACE_ENV)
            ack_timeout = float(grace) / 4 if grace else 120.0
        self.worker_backup, self.ack_timeout = worker_backup, ack_timeout
        self._in_fit, self._validating = False, None

    def on_train_begin(self, logs=None):
        _fits[0] += 1  # A key per Keras fit in the process, alike on every worker (rollbacks, stages).
        self._leave_validation()
        self._in_fit = True
        self._key, self._target, self._named = f"distrib_tf/preempt/{_fits[0]}", None, False
        resolver = getattr(self.model.distribute_strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        self._tasks = [f"{kind}:{i}" for kind in ("chief", "worker") for i in range(len(spec.get(kind, ())))]
        if len(self._tasks) > 1:
            self._me = f"{resolver.task_type}:{resolver.task_id}"
            threading.Thread(target=self._watch, args=(self._key,), name="distrib_tf-preemption",
                             daemon=True).start()

    def _watch(self, key: str):
        """Reads this fit's step once named (its own key: a later fit has another)."""
        value = context.context().get_config_key_value(key)  # Blocks until set.
        if value != _NONE and key == self._key:
            self._target = int(value)
        context.context().set_config_key_value(f"{key}/read/{self._me}", "1")

    def on_train_batch_end(self, batch, logs=None):
        step = self.worker_backup.step
        if _requested and not self._named:
            self._named = True
            if len(self._tasks) <= 1 or not self._name_step(step + 1):
                self._target = step  # One process, or the other workers are gone: this step.
        if self._target is not None and step >= self._target:
            self.worker_backup.save()
            self.worker_backup.flush()
            raise Preempted(step)

    def _name_step(self, target: int) -> bool:
        """Names `target` unless another worker named one first; False if a worker never read it."""
        if not _set_once(self._key, str(target)):
            return True  # Another worker's step: this one's thread reads it.
        try:
            for task in self._tasks:  # Every worker knows the step before this one goes on.
                context.context().get_config_key_value(f"{self._key}/read/{task}",
                                                       timeout_in_ms=int(self.ack_timeout * 1000))
        except tf.errors.OpError:
            return False
        return True

    def on_test_begin(self, logs=None):
        """Validation inside `fit`: every worker backs up the step first, then SIGTERM stops
        it at once (validation runs no training step to agree on)."""
        self._leave_validation()
        if self._in_fit:  # An `evaluate` of its own is its caller's to guard (`saved()`).
            self.worker_backup.save()
            self._validating = saved(self.worker_backup.step)
            self._validating.__enter__()  # pylint: disable=unnecessary-dunder-call

    def on_test_end(self, logs=None):
        self._leave_validation()

    def _leave_validation(self):
        """Also after a validation that SIGTERM ended: its entry would outlive it."""
        validating, self._validating = self._validating, None
        if validating is not None:
            validating.__exit__(None, None, None)

    def on_train_end(self, logs=None):
        self._in_fit = False
        if len(self._tasks) > 1:
            _set_once(self._key, _NONE)  # Ends the watching threads of this fit.


_NONE = "none"


def _set_once(key: str, value: str) -> bool:
    """Sets `key` unless set already (another worker named the step first)."""
    try:
        context.context().set_config_key_value(key, value)
        return True
    except tf.errors.AlreadyExistsError:
        return False
