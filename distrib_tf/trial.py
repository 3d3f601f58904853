"""A sweep's trial as the user's script sees it: its hyperparameters, the same on every worker.

One call in the script names its hyperparameters and their defaults:

    hp = distrib_tf.params(learning_rate=1e-3, units=64, dropout=0.2)

Outside a sweep it returns the defaults, and the script runs as it always did. In a trial
of `distrib-tf-sweep` the swept values replace them: the sweep puts the trial in the
launcher's environment (`DISTRIB_TF_TRIAL`, JSON), which every task it starts inherits, so
every worker reads the same values by construction, with no collective and no file. A
swept value takes its default's type (an integral float for an `int` default, `true` or
`false` for a `bool`); a swept name the script does not declare, or a value of the wrong
type, ends the trial with one line and exit code 2 (the sweep records it and goes on).

The trial also names its directory (`distrib_tf.Run` writes there instead of its
`model_dir`, so every trial's backups, checkpoints and `summary.json` are its own), and
whether the sweep prunes: then, at every epoch's end of every `fit`, the chief waits for
the sweep's word (`decision`), which the sweep writes into the study (`distrib_tf.study`:
the trial is told the storage's URL, the study's name and its number) once it has read the
epoch's metrics from the run's events, and every worker stops at that step if it says so
(`distrib_tf.keras.pruning`). The study is what every node reaches (PostgreSQL, a shared
journal file), so the word needs no disk shared with the sweep.

No TensorFlow here.
"""

import json
import os
import sys
import time

from distrib_tf import exit_codes
from distrib_tf import study

ENV = "DISTRIB_TF_TRIAL"
_seen: dict = {}  # The values `params` returned in this process, for `summary.json`.
_words: list = []  # This process's reader of the sweep's words (`study.Words`), once opened.


def current() -> dict | None:
    """The trial this process runs in (`number`, `params`, `dir`, `prune`, `storage`, `study`), or
    `None` outside a sweep."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if not isinstance(found, dict) or not isinstance(found.get("params"), dict):
        _refuse(f"Invalid {ENV} in the environment. Received: {text[:80]!r}. Expected the JSON object "
                "distrib-tf-sweep sets for its trials.")
    return found


def params(**defaults) -> dict:
    """The script's hyperparameters: `defaults` outside a sweep, the trial's values inside one.

    Example:

        >>> hp = params(learning_rate=1e-3, units=64)
        >>> hp["units"]  # 64 outside a sweep; the trial's value, the same on every worker, inside.
        64
    """
    values = dict(defaults)
    found = current()
    for name, value in (found or {}).get("params", {}).items():
        if name not in defaults:
            _refuse(f"Invalid sweep parameter `{name}` for {_program()}. Received: {name}={value!r}. Expected "
                    f"one that its distrib_tf.params(...) declares: {', '.join(sorted(defaults)) or 'none'}.")
        values[name] = _like(name, value, defaults[name])
    _seen.update(values)
    return values


def seen() -> dict:
    """What `params` returned in this process (empty if it was never called)."""
    return dict(_seen)


def _like(name: str, value, default):
    """`value` as the type of `default`, or the one-line refusal."""
    kind = type(default)
    if default is None or isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    _refuse(f"Invalid sweep value for `{name}` in {_program()}. Received: {value!r} "
            f"({type(value).__name__}). Expected {kind.__name__}, as its default {default!r}.")
    return None


def model_dir(requested: str) -> str:
    """Where a run writes: the trial's own directory in a sweep, else `requested`."""
    found = current()
    return found["dir"] if found and found.get("dir") else requested


def prunes() -> bool:
    """Whether this trial's sweep may prune it at an epoch's end."""
    found = current()
    return bool(found and found.get("prune") and found.get("dir") and found.get("storage"))


def decision(epoch: int, *, fit: int = 1, timeout: float, stop_waiting=lambda: False) -> str:
    """The sweep's word on the trial after `epoch` (1-based) of its `fit`-th fit: `prune` or `go`.

    Reads the study every 0.2 s (`distrib_tf.study.Words`), at most `timeout` seconds, or
    until `stop_waiting()` (a preemption came): then `go`, and the run goes on (a sweep that
    is gone, or a database that does not answer, cannot prune it).
    """
    found = current()
    if not _words:
        _words.append(study.Words(found["storage"], study_name=found.get("study", "distrib_tf"),
                                  number=found["number"]))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop_waiting():
        try:
            word = _words[0].get(fit=fit, epoch=epoch)
        except Exception:  # pylint: disable=broad-except  # A database that does not answer now: again.
            word = None
        if word is not None:
            return "prune" if word == "prune" else "go"
        time.sleep(0.2)
    return "go"


def _program() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # python -m distrib_tf.train
        return spec.name.removesuffix(".__main__")
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "this script"


def _refuse(message: str) -> None:
    """A mistake in the sweep's values: one line, exit code 2 (the sweep records it, goes on)."""
    print(f"{_program()}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(exit_codes.USAGE)
