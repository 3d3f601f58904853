"""Keras's own tests of `fit`, from the sdist of the installed Keras, in a cache directory.

`python tests/keras_contract/fetch.py [CACHE]` downloads `keras==<installed version>`'s
sdist with pip (the package registry only) and unpacks the tests of `keras/src/trainers/`,
`keras/src/callbacks/` and `keras/src/models/` (their `*_test.py` files, at their paths in
Keras) into `CACHE/keras-<version>/` (default `.keras-contract/` in the repository, not
committed); prints that directory. A second call finds them there and downloads nothing.
"""

import os
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata

DIRECTORIES = ("keras/src/trainers/", "keras/src/callbacks/", "keras/src/models/")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE = os.path.normpath(os.path.join(HERE, "..", "..", ".keras-contract"))


def fetch_tests(cache: str = DEFAULT_CACHE, version: str = metadata.version("keras")) -> str:
    """The directory holding Keras `version`'s tests of `DIRECTORIES`; downloads them once."""
    target = os.path.abspath(os.path.join(cache, f"keras-{version}"))
    done = os.path.join(target, ".complete")
    if os.path.exists(done):
        return target
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"keras=={version}", "-d", download], check=True)
        (sdist,) = [os.path.join(download, name) for name in os.listdir(download)]
        prefix = f"keras-{version}/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(DIRECTORIES) and m.name.endswith("_test.py")]
            if not members:
                raise RuntimeError(f"No tests under {DIRECTORIES} in {sdist}. Expected Keras's sdist layout.")
            for member in members:
                member.name = member.name[len(prefix):]
            archive.extractall(target, members=members, filter="data")
    with open(done, "w", encoding="utf-8") as f:
        f.write(f"{len(members)} test files of keras {version}\n")
    return target


if __name__ == "__main__":
    print(fetch_tests(*sys.argv[1:2]))
