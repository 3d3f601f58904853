"""The TensorFlow versions distrib_tf is tested with, and one warning at import outside them.

`import distrib_tf` reads the installed TensorFlow's version from its package metadata (it
imports no TensorFlow, so the launcher stays light) and, outside `TESTED_TENSORFLOW`,
warns once with an `UntestedVersionWarning` (a `UserWarning`; nothing is refused):

    UntestedVersionWarning: TensorFlow 2.17.1 is not a version distrib_tf is tested
    with (2.18 to 2.21): ...

setup.cfg declares the same range; `make test` runs 2.21, `make test-tf` each older minor.
"""

import importlib.metadata
import re
import sys
import warnings

# Inclusive (major, minor) range; setup.cfg's `tensorflow>=2.18,<2.22`.
TESTED_TENSORFLOW = ((2, 18), (2, 21))
# The distributions that install the `tensorflow` module on Linux.
_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu")


class UntestedVersionWarning(UserWarning):
    """TensorFlow's version is outside the range distrib_tf was tested with."""


def tensorflow_version() -> str | None:
    """The installed TensorFlow's version, from its package metadata; None if none is."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_tested(version: str) -> bool:
    """Whether `version` ("2.19.1", "2.22.0rc0") is inside `TESTED_TENSORFLOW`. Pure."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return False
    low, high = TESTED_TENSORFLOW
    return low <= (int(match[1]), int(match[2])) <= high


def tested_range() -> str:
    low, high = TESTED_TENSORFLOW
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"


def warn_if_untested() -> None:
    """Warns once (`UntestedVersionWarning`) when the installed TensorFlow is outside the range."""
    version = tensorflow_version()
    if version is None or is_tested(version):
        return
    warnings.warn(
        f"TensorFlow {version} is not a version distrib_tf is tested with ({tested_range()}): "
        f"it may work, or fail in Keras's internals (pip install 'tensorflow>=2.18,<2.22').",
        UntestedVersionWarning, stacklevel=_importer_level())


def _importer_level() -> int:
    """The stack level of the code that imported distrib_tf: past our own frames (`warnings`
    itself skips importlib's, and does not count them)."""
    package = __name__.rpartition(".")[0]
    frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
    while frame is not None:
        internal = "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename
        if not internal and frame.f_globals.get("__name__", "").split(".")[0] != package:
            return level
        if not internal:
            level += 1
        frame = frame.f_back
    return level
