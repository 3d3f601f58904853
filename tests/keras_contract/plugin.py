"""The pytest plugin that runs Keras's own tests plainly or with a live `distrib_tf.Run`.

Loaded by `contract.py` (`-p plugin`), in one process per variant, chosen by the
environment variable `DISTRIB_TF_CONTRACT_VARIANT`:

- `plain`: Keras alone, no strategy;
- `plain-mirrored`: Keras under `make_strategy("mirrored", cpu_replicas=2)` as the default
  strategy, no run (what Keras's own `fit` does on 2 replicas);
- `run`: a live `distrib_tf.Run` on one device: every `model.fit` goes through `Run.fit`;
- `run-mirrored`: the same with `strategy="mirrored", cpu_replicas=2`;
- `plain-one-device`: Keras under `make_strategy("one_device")`, no run (not in `make
  test-keras`: to tell a fault of the run from one of Keras under a strategy).

The strategy and the run are made when pytest configures, before any test module runs a
TensorFlow op. Keras's `TestCase.setUp` calls `clear_session()`, which resets TensorFlow's
default graph and with it the default strategy the run set: the plugin sets it again after
each `setUp` (a script that calls `clear_session()` after `Run(...)` loses it the same way).

Each test's outcome (passed, failed, skipped), its error's last line and how many of its
`fit` calls went through `Run.fit` are written as JSON to `DISTRIB_TF_CONTRACT_RESULTS`.
With pytest-xdist (`-n 2`) each worker makes its own strategy and run, ships a test's
count of routed fits in its report (`user_properties`), and the controller (which makes
neither) writes the file. `DISTRIB_TF_CONTRACT_ONLY`, a file of test ids one a line,
runs those tests only (`contract.py` runs the plain variant on what fails with the run).
"""

import importlib.util
import json
import os
import sys
import tempfile
import types
import zlib

import pytest

VARIANTS = ("plain", "plain-mirrored", "run", "run-mirrored", "plain-one-device")
_state = {"strategy": None, "run": None, "routed": 0, "results": {}}


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's own marker (TensorFlow is one)")
    config.addinivalue_line("markers", "multi_device: Keras's own marker")
    variant = os.environ.get("DISTRIB_TF_CONTRACT_VARIANT", "plain")
    if variant not in VARIANTS:
        raise pytest.UsageError(f"Invalid value for environment variable `DISTRIB_TF_CONTRACT_VARIANT`. "
                                f"Received: {variant!r}. Expected one of {VARIANTS}.")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if _is_xdist_controller(config):  # It collects no test module: no Keras, no TensorFlow.
        return
    # Imported before the test modules: pytest's importlib mode would otherwise make an
    # empty `keras.src` for `keras/src/callbacks/x_test.py` (no `__init__.py` in the cache).
    import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    _stand_in_for_keras_repo()
    if variant == "plain":
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (after the variant is known)

    import distrib_tf  # pylint: disable=import-outside-toplevel

    mirrored = variant.endswith("mirrored")
    if variant.startswith("run"):
        model_dir = tempfile.mkdtemp(prefix="keras_contract_run_")
        run = distrib_tf.Run(model_dir, strategy="mirrored" if mirrored else "one_device",
                             cpu_replicas=2 if mirrored else None, exit_on_error=False)
        fit = run.fit

        def counted_fit(*args, **kwargs):
            _state["routed"] += 1
            return fit(*args, **kwargs)

        run.fit = counted_fit  # `routing` calls the live run's `fit`: this instance's.
        _state["run"], _state["strategy"] = run, run.strategy
    else:
        _state["strategy"] = (distrib_tf.make_strategy("mirrored", cpu_replicas=2) if mirrored
                              else distrib_tf.make_strategy("one_device"))
        tf.distribute.experimental_set_strategy(_state["strategy"])
    from keras.src.testing import test_case  # pylint: disable=import-outside-toplevel

    set_up = test_case.TestCase.setUp

    def set_up_under_strategy(self):
        set_up(self)  # clear_session(): TensorFlow's default graph, and its default strategy, are new.
        if tf.distribute.get_strategy() is not _state["strategy"]:
            tf.distribute.experimental_set_strategy(_state["strategy"])

    test_case.TestCase.setUp = set_up_under_strategy


def _is_xdist_controller(config) -> bool:
    """Whether this process hands the tests out to pytest-xdist's workers (and runs none)."""
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


class _Absent(types.ModuleType):
    """A package this machine lacks, importable so that a test module naming it at its top
    loads; any use of it raises `ModuleNotFoundError`, plainly and with the run alike."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(f"No module named {self.__name__!r} (keras_contract's stand-in: "
                                  f"{self.__name__}.{name} is used)")


def _stand_in_for_keras_repo() -> None:
    """What Keras's tests import from Keras's repository beyond the sdist: its root
    `conftest.py`'s `skip_if_backend`, and `jax` (`trainer_test.py` imports it at its top,
    for the JAX backend's tests only; TensorFlow's tests never use it)."""
    if "conftest" not in sys.modules:
        conftest = types.ModuleType("conftest")
        conftest.skip_if_backend = lambda given, reason: pytest.mark.skipif(
            os.environ.get("KERAS_BACKEND") == given, reason=reason)
        sys.modules["conftest"] = conftest
    if importlib.util.find_spec("jax") is None:
        for name in ("jax", "jax.experimental", "jax.experimental.sparse"):
            sys.modules[name] = _Absent(name)


def pytest_collectreport(report):
    if report.failed:
        _state["results"][report.nodeid] = {"outcome": "failed", "error": _last_line(report), "routed_fits": 0}


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("DISTRIB_TF_CONTRACT_ONLY")
    if not path:
        return
    with open(path, encoding="utf-8") as f:
        wanted = {line.strip() for line in f if line.strip()}
    deselected = [item for item in items if item.nodeid not in wanted]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.nodeid in wanted]


def pytest_runtest_setup(item):
    """Each test starts from its own seed, the same in every variant and process: Keras draws
    an unseeded layer's initial weights from Python's `random`, which is seeded anew in each
    process (a test that diverges from one start in six would pass or fail by chance)."""
    _state["routed"] = 0
    import keras  # pylint: disable=import-outside-toplevel  (imported at pytest_configure)

    keras.utils.set_random_seed(zlib.crc32(item.nodeid.encode()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":  # In the report: it travels from an xdist worker to the controller.
        outcome.get_result().user_properties.append(("routed_fits", _state["routed"]))


def pytest_runtest_logreport(report):
    results = _state["results"]
    entry = results.setdefault(report.nodeid, {"outcome": "passed", "error": "", "routed_fits": 0})
    if report.when == "call":
        entry["routed_fits"] = dict(report.user_properties).get("routed_fits", 0)
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    elif report.failed:
        entry["outcome"] = "failed"
        entry["error"] = entry["error"] or _last_line(report)
        entry["where"] = entry.get("where") or _deepest_own_frame(report)
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["raised"] = entry.get("raised") or (f"{crash.path}:{crash.lineno}" if crash is not None else "")


def _last_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]


def _deepest_own_frame(report) -> str:
    """The last traceback line in distrib_tf's code (`distrib_tf/run/stage.py:120`), or ""."""
    chain = getattr(report.longrepr, "chain", None) or [(getattr(report.longrepr, "reprtraceback", None),)]
    where = ""
    for traceback, *_ in chain:
        for entry in getattr(traceback, "reprentries", ()):
            location = getattr(entry, "reprfileloc", None)
            path = str(getattr(location, "path", ""))
            if "distrib_tf/" in path:
                where = f"{path[path.rindex('distrib_tf/'):]}:{location.lineno}"
    return where


def pytest_sessionfinish(session):
    path = os.environ.get("DISTRIB_TF_CONTRACT_RESULTS")
    if path and not hasattr(session.config, "workerinput"):  # An xdist worker's results are the controller's.
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_state["results"], f, indent=0, sort_keys=True)
    run = _state["run"]
    if run is not None:
        run.end()
