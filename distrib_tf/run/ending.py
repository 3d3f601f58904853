"""How a run's process ends, case by case: the exit code a scheduler reads, one line saying
why, and every worker leaving alike. `Run` and the main job call this module; what a SIGTERM
does in each phase is `distrib_tf.keras.sigterm`'s, which phases a run is in is decided here.

| raised in the run                     | exit code                    | a scheduler      |
| ------------------------------------- | ---------------------------- | ---------------- |
| `Preempted` (SIGTERM)                 | 75 `PREEMPTED`, state saved  | starts it again  |
| `pruning.Pruned` (a sweep pruned it)  | 3 `PRUNED`, state saved      | does not retry   |
| `nonfinite.NonFiniteLoss`             | 65 `NONFINITE`               | does not retry   |
| `resume.ResumeError`, `InvalidRun`,   | 2 `USAGE`, nothing lost      | does not retry   |
| a scope of another strategy           |                              |                  |
| anything else                         | the traceback, as Python's   | may retry        |

A SIGTERM to one worker of several (its peers hear of it through the coordination service),
in a script on the run API (`docs/keras.md` holds the same table with the tests of each row):

| when                                              | every worker                                   |
| ------------------------------------------------- | ---------------------------------------------- |
| `Run(...)` itself, the script's code before `fit` | ends by SIGTERM's default meaning (143)        |
| a `fit`'s start-up (its resume agreement)         | 75 at once, the backups as they were           |
| inside `fit`, a training step, its `on_train_end` | agree on one step, back it up, 75 when `fit`   |
|                                                   | returns at the latest                          |
| an epoch's last step (`fit`'s too), validation    | 75 at once, the step before the epoch's last   |
|                                                   | backed up: the restart makes that end once     |
| an epoch's `on_epoch_end` callbacks               | every worker ends the epoch, backs it up, 75   |
| after `fit`, every worker's `fit` ended (`end_fit`)| 75 at once: each backed up its last step      |
| the outputs (`run.save`, the clean end)           | 75 at once                                     |

`end_fit` is where every `fit` ends: every worker's backups and every file its callbacks
wrote are on the disk (synced) before any worker returns from `fit`, so the script's lines
after it read the chief's files; then a SIGTERM in the script's own code exits 75 at once
(a restart returns each finished `fit` at once and runs the rest of the script again).
With or without `with`, leaving comes from here: `leave_block` for the `with` block,
`take_uncaught` (an uncaught error, the script's end) without it.

No TensorFlow at import.
"""

import atexit
import os
import re
import signal
import sys
import time
import traceback as traceback_lib

from distrib_tf import events
from distrib_tf import exit_codes


class InvalidRun(ValueError):
    """A run's arguments, model or data cannot run as given; exit code 2."""


def classify(error: BaseException) -> int | None:
    """The exit code for `error`, or `None` when it is not one a scheduler acts on."""
    # pylint: disable=import-outside-toplevel  (TensorFlow's modules: only once a run exists)
    from distrib_tf.keras import nonfinite
    from distrib_tf.keras import pruning
    from distrib_tf.keras import resume
    from distrib_tf.keras import sigterm

    if isinstance(error, pruning.Pruned):
        return exit_codes.PRUNED
    if isinstance(error, sigterm.Preempted):
        return exit_codes.PREEMPTED
    if isinstance(error, nonfinite.NonFiniteLoss):
        return exit_codes.NONFINITE
    if isinstance(error, (resume.ResumeError, InvalidRun)) or _another_strategy(error):
        return exit_codes.USAGE
    return None


def _another_strategy(error: BaseException) -> bool:
    """TensorFlow's refusal of a script's own strategy's `scope()` while a run is live."""
    return isinstance(error, RuntimeError) and str(error).startswith(
        "Mixing different tf.distribute.Strategy objects")


def describe(error: BaseException, task: str) -> str:
    """The one line printed for `error` (see `classify`)."""
    code = classify(error)
    if code in (exit_codes.PREEMPTED, exit_codes.PRUNED):
        return error.describe(task)
    if code == exit_codes.NONFINITE:
        return f"{task}: {error} Every worker stopped at this step."
    if _another_strategy(error):
        entered = re.findall(r"\.(\w+) object at", str(error))[-1:] or ["another strategy"]
        return (f"Invalid strategy scope: the script entered the scope of a strategy of its own while a run is "
                f"live. Received: {entered[0]}.scope(). Expected: the run's, `run.strategy.scope()` (or no scope: "
                "the run's strategy is the default one)")
    return str(error)


def exit_for(error: BaseException, task: str, *, program: str, strategy=None, is_chief: bool = False) -> None:
    """Prints `error`'s line, emits the `failed` event and exits with its code; returns only
    for an error that is not one of `classify`'s (after emitting its first line).

    A preempted worker of several (`strategy` spans processes) leaves at once, without the
    interpreter's teardown, the chief (the coordination service's host) a moment after the
    others: its backup is on the disk, and a teardown that waits on tf.data's threads or on
    a coordination service already gone could outlast the scheduler's grace and end the
    task by SIGKILL, a code that no longer says "saved".
    """
    code = classify(error)
    if code is None:
        first_line = next(iter(str(error).strip().splitlines()), "")
        events.emit("failed", error=f"{type(error).__name__}: {first_line}")
        return
    if code in (exit_codes.PREEMPTED, exit_codes.PRUNED):  # Every worker backed up one step: leave.
        from distrib_tf.keras import sigterm  # pylint: disable=import-outside-toplevel

        sigterm.leaving()
        print(describe(error, task), flush=True)
        # A task gets SIGTERM twice (its process group's, and its init's forwarded copy), and
        # the interpreter's teardown restores SIGTERM's default, which would end it by the signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if strategy is not None and _spans_processes(strategy):
            sigterm.told_peers()  # The others learn of it from the key, not from a dead peer.
            sys.stdout.flush()
            sys.stderr.flush()
            if is_chief:
                time.sleep(LEAVE_CHIEF_AFTER_SECONDS)
            os._exit(code)
    else:
        print(f"{program}: error: {describe(error, task)}", file=sys.stderr, flush=True)
        events.emit("failed", error=describe(error, task))
    sys.exit(code)


def take_uncaught(run) -> None:
    """For a run used without `with` (`run = Run(...)` at the top of a script): an uncaught
    error of `classify`'s leaves by its code with its one line, as the `with` block does,
    and a script that ends normally ends the run (`Run.end`, then leaving together)."""
    previous = sys.excepthook

    def hook(kind, error, traceback):
        run._crashed = True  # pylint: disable=protected-access  (no clean end at exit)
        if not run._ended and isinstance(error, Exception) and classify(error) is not None:  # pylint: disable=protected-access
            try:
                exit_for(error, run.task, program=program(), strategy=run.strategy, is_chief=run.is_chief)
            except SystemExit as leaving:
                sys.stdout.flush()
                sys.stderr.flush()
                atexit._run_exitfuncs()  # pylint: disable=protected-access  (the script's own hooks)
                os._exit(leaving.code)
        previous(kind, error, traceback)

    def end_at_exit():
        if run._ended or getattr(run, "_crashed", False):  # pylint: disable=protected-access
            return
        try:
            _end_and_leave_together(run)
        except Exception as e:  # pylint: disable=broad-except  (inside atexit: its code is lost unless here)
            if classify(e) is None:
                events.emit("failed", error=f"{type(e).__name__}: {next(iter(str(e).splitlines()), '')}")
                traceback_lib.print_exc()
                _exit_now(exit_codes.FAILED)
            try:
                exit_for(e, run.task, program=program(), strategy=run.strategy, is_chief=run.is_chief)
            except SystemExit as leaving:
                _exit_now(leaving.code)

    sys.excepthook = hook
    atexit.register(end_at_exit)


def leave_block(run, error: BaseException | None) -> None:
    """The end of `with Run(...)`: the clean end and leaving together, or `error`'s exit code
    (a SIGTERM in the clean end too: 75, not a traceback); with `exit_on_error=False`, the
    clean end alone, its errors raised as they are."""
    if error is not None:
        if run.exit_on_error and isinstance(error, Exception):
            exit_for(error, run.task, program=program(), strategy=run.strategy, is_chief=run.is_chief)
        return
    if not run.exit_on_error:
        run.end()
        return
    try:
        _end_and_leave_together(run)
    except Exception as e:
        exit_for(e, run.task, program=program(), strategy=run.strategy, is_chief=run.is_chief)
        raise


def _end_and_leave_together(run) -> None:
    from distrib_tf.keras import sigterm  # pylint: disable=import-outside-toplevel

    run.end()
    if run._fitted and _spans_processes(run.strategy):  # pylint: disable=protected-access
        leave_together(run.strategy, run.is_chief)
    sigterm.settle(None)  # The run is over: SIGTERM means what it meant before it.


def end_fit(run) -> None:
    """Every `fit` of a run ends here, on every worker, inside its guarded phase: its backups
    and every file its callbacks wrote (the chief's checkpoints, a `ModelCheckpoint`'s) are
    on the disk, synced, and under several workers every worker meets at a barrier before
    any returns; then a SIGTERM leaves with 75 at once (`sigterm.settle`), and one that came
    in `fit` after its last agreed step (its last step, an `on_train_end`) leaves now."""
    # pylint: disable=import-outside-toplevel  (TensorFlow's modules: only once a run exists)
    from distrib_tf.keras import backup
    from distrib_tf.keras import phases
    from distrib_tf.keras import sigterm

    backup.WRITER.wait()
    if _spans_processes(run.strategy):
        os.sync()  # What the callbacks wrote, on the disk before a peer reads it.
        _FITS_ENDED[0] += 1
        said = f"distrib_tf/fit_end/{_FITS_ENDED[0]}"
        tasks = list(dict.fromkeys(run.replica_tasks))
        try:  # Each worker says whether a SIGTERM came (the peers' watch may deliver it late).
            sigterm.say(f"{said}/{run.task}")
            phases.enter(run.strategy, "fit_end")
            sigterm.hear([f"{said}/{task}" for task in tasks])
        except Exception:  # A peer gone: preempted (then so is this worker), or dead.
            sigterm.check(run.step)
            raise
    sigterm.settle(run.step)


_FITS_ENDED = [0]


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def program() -> str:
    """The script's name, for its error lines."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "python"


def _spans_processes(strategy) -> bool:
    from distrib_tf.keras import phases  # pylint: disable=import-outside-toplevel

    return phases.is_multi_worker(strategy)


LEAVE_BARRIER_MS = 60_000
LEAVE_CHIEF_AFTER_SECONDS = 0.5


def leave_together(strategy, is_chief: bool, *, exit_now: bool = False) -> None:
    """Every training task done: they meet at a barrier every task reaches only once its
    outputs are written, then return, the chief (the coordination service's host) a moment
    after the others, so that no worker reports a coordination service that is gone.

    A user's script then goes on and ends as a Python program does: code after the `with`
    block, `finally` clauses and `atexit` hooks run (measured: 1 to 4 s more than leaving
    without the interpreter's teardown, for the 2-worker example; no error in its output).
    `exit_now` (the main job's CLI, which has nothing after it): leave at once with code 0,
    without the interpreter's teardown (which waits seconds for tf.data's threads: 3 to 8 s
    a run of the main job under `make test`). Returns at once if a peer is gone.
    """
    from distrib_tf.keras import phases  # pylint: disable=import-outside-toplevel

    try:
        phases.enter(strategy, "job_end", LEAVE_BARRIER_MS / 1000)
    except Exception:  # pylint: disable=broad-except  (a peer gone: leave the usual way)
        return
    if is_chief:
        time.sleep(LEAVE_CHIEF_AFTER_SECONDS)
    if exit_now:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_codes.OK)
