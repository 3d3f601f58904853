"""A script's own `model.fit(...)` gets every guarantee while a `Run` is live.

From `Run(...)` until its end, a model built in the script (its strategy is the run's,
which the run makes the default: `tf.distribute.experimental_set_strategy`) trains
through `Run.fit` when the script calls `model.fit(...)`: the same arguments, the same
History, and the run's exact resume, preemption and NaN stop. A Keras script so changes no
line; `run.fit(model, ...)` is the same call spelt out.

This is the one place where distrib_tf takes Keras's `fit` for a model: `keras.Model.fit`
is wrapped while a run is live and given back at its end. Models under another strategy
(a scope of the script's own), and `Run.fit`'s own calls of Keras's `fit`, go straight to
Keras; a model under no strategy (built before `Run(...)`) comes to `Run.fit`, which refuses
it in one line rather than training it alone on each worker. `evaluate` and `predict` stay
Keras's own, but on a training worker other than the chief they run with `verbose=0`: the
chief speaks for the job (Keras's progress bars there, as for `fit`; none from the others).

`keras.backend.clear_session()` resets TensorFlow's default graph, and with it the default
strategy: while a run is live, the run's strategy is made the default again right after
(`tf.compat.v1.reset_default_graph`, which Keras calls, is wrapped too), so the script's
next model is built under the run as before.

Example:

    >>> run = distrib_tf.Run("runs/mnist")
    >>> model = keras.Sequential([...]); model.compile(...)
    >>> model.fit(x, y, batch_size=128, epochs=3, validation_split=0.1)  # Run.fit(model, x, y, ...)
"""

import contextlib
import functools
import inspect
import threading

import keras
import tensorflow as tf

_live = []  # The live Run, if any (one per process).
_inside = threading.local()  # Set while Run.fit calls Keras's own fit.


def activate(run) -> None:
    """`model.fit` of models under `run.strategy` goes through `run.fit` from now on."""
    if "fit" not in vars(keras.Model):  # Keras's own is its trainer's, above Model.

        @functools.wraps(keras.Model.fit)
        def fit(self, *args, **kwargs):
            current = _live[-1] if _live else None
            if current is None or getattr(_inside, "on", False) or not _belongs(self, current):
                return super(keras.Model, self).fit(*args, **kwargs)
            return current.fit(self, *args, **kwargs)

        keras.Model.fit = fit
    for name in _QUIET_ELSEWHERE:
        if name not in vars(keras.Model):
            setattr(keras.Model, name, _quiet_off_the_chief(getattr(keras.Model, name)))
    if not hasattr(tf.compat.v1.reset_default_graph, "__wrapped__"):
        reset = tf.compat.v1.reset_default_graph

        @functools.wraps(reset)
        def reset_default_graph():
            reset()
            if _live:
                tf.distribute.experimental_set_strategy(_live[-1].strategy)

        tf.compat.v1.reset_default_graph = reset_default_graph
    _live[:] = [run]


def deactivate(run) -> None:
    """Gives Keras's `fit`, `evaluate`, `predict` and TensorFlow's `reset_default_graph` back
    once `run` ends."""
    if _live and _live[-1] is run:
        _live.clear()
        for name in ("fit", *_QUIET_ELSEWHERE):
            if name in vars(keras.Model):
                delattr(keras.Model, name)
        if hasattr(tf.compat.v1.reset_default_graph, "__wrapped__"):
            tf.compat.v1.reset_default_graph = tf.compat.v1.reset_default_graph.__wrapped__


def live():
    """The live run, or `None`."""
    return _live[-1] if _live else None


_QUIET_ELSEWHERE = ("evaluate", "predict")  # Keras's own, with verbose=0 on a worker other than the chief.


def _quiet_off_the_chief(method):
    """Keras's `method` (`evaluate`, `predict`), with `verbose=0` for a model of the live run
    on a training worker other than the chief."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def quiet(self, *args, **kwargs):
        current = _live[-1] if _live else None
        if current is not None and not (current.is_chief or current.is_evaluator) and _belongs(self, current):
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["verbose"] = 0
            args, kwargs = bound.args[1:], bound.kwargs
        return getattr(super(keras.Model, self), method.__name__)(*args, **kwargs)

    return quiet


def _belongs(model, run) -> bool:
    """Whether `model`'s `fit` is the run's: built under its strategy, or under none."""
    strategy = model.distribute_strategy
    return strategy is run.strategy or type(strategy).__name__ == "_DefaultDistributionStrategy"


@contextlib.contextmanager
def plain_fit():
    """Inside, `model.fit` is Keras's own (what `Run.fit` calls)."""
    before = getattr(_inside, "on", False)
    _inside.on = True
    try:
        yield
    finally:
        _inside.on = before
