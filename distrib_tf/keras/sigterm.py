"""What a SIGTERM means in each phase of a process, and leaving with 75 from a signal.

Clusters take machines back with a SIGTERM first (Slurm before a preemption or the end of
a time limit, Kubernetes before an eviction). `install()` makes SIGTERM's handler this
module's; what it does depends on the phase the process is in when it comes:

| phase (innermost wins)                                  | SIGTERM                                       |
| ------------------------------------------------------- | --------------------------------------------- |
| `saved(step)`: every worker's backup holds `step` (a    | leave with 75 at once (`leave`)               |
| stage's start-up with `None`, an epoch's end up to its  |                                               |
| `on_epoch_end` callbacks with the step before its last, |                                               |
| the chief's outputs)                                    |                                               |
| `guarded()`: a `fit`'s training                         | recorded: `SaveOnPreemption` agrees on a step |
| `settle(step)`: after a `fit` that every worker ended   | leave with 75 at once, like `saved(step)`     |
| and backed up, in the script's own code                 |                                               |
| elsewhere, `install(outside_phases="default")`          | its default meaning, on every worker          |
| elsewhere (the main job: `"record"`)                    | recorded                                      |

Leaving with 75 from the handler: one of several workers waits for the backups in flight,
tells its peers (`watch_peers`), prints its line and ends at once (`os._exit`): it never
raises into the wait the main thread is in (a barrier or a collective whose peer just
left: the exception raised into TensorFlow's C++ call came out as `RuntimeError:
pybind11::error_already_set: MISMATCH ...`, exit 1); one process raises `Preempted`. A
watchdog thread ends a main thread stuck in a C call that will not return.

`distrib_tf.run.ending` decides the phases of a run (`distrib_tf.keras.preemption` agrees
on the step inside a `fit`).
"""

import contextlib
import os
import signal
import sys
import threading
import time

import tensorflow as tf
from tensorflow.python.eager import context  # The coordination service's key-value store.

from distrib_tf import exit_codes
from distrib_tf.keras import backup

GRACE_ENV = "DISTRIB_TF_GRACE_SECONDS"  # Set by `distrib_tf.launch` from its `--grace_period`.
STUCK_SECONDS = 3.0  # A SIGTERM to leave on that the main thread has not acted on by then.
LEADER_LEAVES_AFTER_SECONDS = 0.5  # The coordination service's host leaves last.
PEERS_KEY = "distrib_tf/preempt/any"
NONE = "none"  # A key's value that ends the threads waiting on it.
_UNSETTLED = object()


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


class _State:  # pylint: disable=too-few-public-methods
    """The process's phase and what a SIGTERM left behind."""
    installed = requested = leaving = outside_default = leader = handling = False
    task = "this task"
    saved: list = []  # Innermost last: the step every worker's backup holds (`saved()`).
    guards = 0  # `guarded()` phases entered.
    settled = _UNSETTLED  # `settle(step)`.
    peers_key: str | None = None
    telling: list = []  # The thread naming PEERS_KEY, once a SIGTERM came.


_s = _State()


def install(*, outside_phases: str = "record") -> None:
    """SIGTERM's handler is this module's (main thread only): see the phases above.

    `outside_phases="default"`: outside every phase (a user's script loading its data before
    `fit`) SIGTERM keeps its default meaning and ends the process, its peers told first. A
    handler already installed keeps its mode (the main job's records always).

    Making a `MultiWorkerMirroredStrategy` installs TensorFlow's own SIGTERM handler (the
    coordination service's preemption notifier, which does not stop the process): call
    this after it, or `reclaim()` once it is made.
    """
    if not _s.installed:
        _start_watchdog()
        _s.outside_default = outside_phases == "default"
    _s.installed = True
    signal.signal(signal.SIGTERM, _handle)


def reclaim() -> None:
    """Takes SIGTERM back from TensorFlow's notifier, if `install()` was called."""
    if _s.installed:  # `signal.getsignal` cannot tell: it answers what Python last set.
        signal.signal(signal.SIGTERM, _handle)


def set_task(task: str, *, leader: bool = False) -> None:
    """Names this worker in the line a preemption prints (`worker:1`); `leader`: it hosts the
    coordination service (the chief), and leaves a moment after the others."""
    _s.task, _s.leader = task, leader


def _meaning():
    """What a SIGTERM does now: `("leave", step)`, `("record", None)` or `("default", None)`."""
    if _s.saved:
        return "leave", _s.saved[-1]
    if _s.guards:
        return "record", None
    if _s.settled is not _UNSETTLED:
        return "leave", _s.settled
    return ("default" if _s.outside_default else "record"), None


def _handle(signum, frame):
    # A second SIGTERM while the first is handled (a peer's word, the launcher's, the
    # watchdog's) runs this again inside it, between two bytecodes of the first: the first,
    # which means the same, acts for both. (Run nested, it joined a thread the first had not
    # yet started, and left with 1 instead of 75.)
    if _s.handling:
        return
    _s.handling = True
    try:
        meaning, step = _meaning()
        first = not _s.requested
        _s.requested = True
        if first and _s.peers_key is not None:  # Every worker, in whatever phase it is, is told.
            _s.telling.append(threading.Thread(target=_tell, args=(_s.peers_key,), daemon=True))
            _s.telling[-1].start()
        if meaning == "default":  # Not ours to save: as if never installed, once the peers know.
            told_peers()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if meaning == "leave":
            leave(step)
    finally:
        _s.handling = False


def leave(step: int | None) -> None:
    """Leaves with 75 now, every worker's backup holding `step`: one of several workers ends
    from here (`os._exit`), one process raises `Preempted(step)`."""
    if _s.peers_key is not None:  # Several workers: never raise into what the main thread waits in.
        _leave(step)
    _written()
    raise Preempted(step)  # One process: no peer's departure can end a wait under it.


def _leave(step: int | None) -> None:
    """Ends this task with 75 at once: its backup holds `step`, like every worker's (once
    the background writer has put it on the disk)."""
    _s.leaving = True
    _written()
    told_peers()
    print(Preempted(step).describe(_s.task), flush=True)
    sys.stderr.flush()
    if _s.leader:
        time.sleep(LEADER_LEAVES_AFTER_SECONDS)
    os._exit(exit_codes.PREEMPTED)


def leaving() -> None:
    """The main thread is leaving on a preemption: the watchdog has nothing left to do."""
    _s.leaving = True


def _written() -> None:
    """Waits for the backups in flight (`backup.WRITER`); a task whose backup could not be
    written did not save its state: it says so and exits 1, not 75."""
    try:
        backup.WRITER.wait()
    except Exception as e:  # pylint: disable=broad-except
        print(f"{_s.task}: preempted, but its backup was not written: {type(e).__name__}: {e}", flush=True)
        os._exit(exit_codes.FAILED)


def _start_watchdog() -> None:
    """A SIGTERM wakes a thread (Python's wakeup fd is written by the C-level handler, even
    while the main thread waits inside TensorFlow); if the main thread has not left within
    `STUCK_SECONDS` where it should, it is stuck in a wait that a peer's departure will never
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
    if _meaning()[0] == "default":
        # The kernel may have handed the signal to another thread (TensorFlow's, or this one):
        # a main thread asleep in a C call (a script's time.sleep, a read) would then run the
        # handler, SIGTERM's default meaning, only once that call returns, minutes later.
        # Sent to the main thread, the signal ends the call and the handler runs at once.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    time.sleep(STUCK_SECONDS)
    meaning, step = _meaning()
    if meaning == "leave" and not _s.leaving:
        _leave(step)


@contextlib.contextmanager
def guarded():
    """Inside (a `fit`: its callbacks agree on a step, save and stop), SIGTERM is recorded."""
    _s.guards += 1
    try:
        yield
    finally:
        _s.guards -= 1


@contextlib.contextmanager
def saved(step: int | None):
    """Inside, a SIGTERM leaves with 75 at once (and on entry, if one came): `leave(step)`.

    For the phases that change no weight: enter once every worker's backup holds `step`
    (`None`: before training, with the backups as they were) and keep inside only work
    that a restart can redo, whose files appear by a rename (the export). A worker still
    inside a collective there is not waited for: its backup holds `step` too.
    Without `install()` it does nothing.
    """
    _s.saved.append(step)
    try:
        if _s.requested:
            leave(step)
        yield
    finally:
        _s.saved.pop()


def settle(step: int | None) -> None:
    """From now on, outside the other phases, a SIGTERM leaves with 75 at once: every worker
    ended a `fit` and backed up `step` (a restart returns it at once and runs the rest of the
    script again); and leaves now if one came. `None`: the run ended, SIGTERM is as before."""
    _s.settled = _UNSETTLED if step is None else step
    if step is not None and _s.requested:
        leave(step)


def requested() -> bool:
    """Whether a SIGTERM came: this worker's, or a peer's (`watch_peers`)."""
    return _s.requested


def request() -> None:
    """Asks for a preemption save at the next step, as SIGTERM does."""
    _s.requested = True


def check(step: int | None) -> None:
    """Raises `Preempted(step)` if a SIGTERM came (this worker's, or a peer's through
    `watch_peers`): for a wait that a peer's departure ended with an error."""
    if _s.requested:
        raise Preempted(step)


def watch_peers(strategy) -> None:
    """Under several workers: a SIGTERM to any one of them reaches this one as its own.

    A worker's first SIGTERM names `PEERS_KEY` in the coordination service's key-value store;
    a thread on every worker waits on that key and sends its own process SIGTERM. So a
    SIGTERM that ends its worker at once ends every worker alike, instead of leaving the
    others to fail at their next collective; in the training batches the peers join the
    agreement on one step (`SaveOnPreemption`) as they would have anyway. Call it once,
    after `install()`; `stop_watching()` at the clean end.
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if _s.peers_key is not None or sum(len(spec.get(kind, ())) for kind in ("chief", "worker")) < 2:
        return
    _s.peers_key = PEERS_KEY

    def wait():
        try:
            value = context.context().get_config_key_value(PEERS_KEY)  # Blocks until set.
        except Exception:  # pylint: disable=broad-except  (the service gone: nothing to hear)
            return
        if value == "sigterm" and not _s.requested:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="distrib_tf-peers-preemption", daemon=True).start()


def stop_watching() -> None:
    """The run ended: the peers' watch is released (a SIGTERM from now on concerns no peer)."""
    if _s.peers_key is not None:
        _set_once(_s.peers_key, NONE)


def say(key: str) -> None:
    """Before a barrier: names `key` `"sigterm"` if one came to this worker, else `NONE`."""
    context.context().set_config_key_value(key, "sigterm" if _s.requested else NONE)


def hear(keys) -> None:
    """After that barrier (every `say` done): a SIGTERM any worker said is this one's too."""
    if not _s.requested and any(context.context().get_config_key_value(k) == "sigterm" for k in keys):
        _s.requested = True


def told_peers(timeout: float = 5.0) -> None:
    """Waits (at most `timeout` s) until the peers were told of this worker's SIGTERM: before a
    preempted worker leaves at once, its key must be in the coordination service."""
    for thread in _s.telling:
        if thread.ident is not None:  # Started (a handler's start can be cut short by an exit).
            thread.join(timeout)


def _tell(key: str) -> None:
    """Names `key` for the peers; a coordination service already gone (its host left
    first, having told them) has no one left to tell."""
    try:
        _set_once(key, "sigterm")
    except tf.errors.OpError:
        pass


def _set_once(key: str, value: str) -> bool:
    """Sets `key` unless set already (another worker named it first)."""
    try:
        context.context().set_config_key_value(key, value)
        return True
    except tf.errors.AlreadyExistsError:
        return False
