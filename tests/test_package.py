"""The package's public surface: what `import distrib_tf` shows, documents and ships."""

import configparser
import inspect
import os
import subprocess
import sys

import distrib_tf

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_dir_shows_every_public_name_and_no_module_of_its_own_imports():
    """Issue 45: `dir(distrib_tf)` showed `importlib` and `logging` but not `Run`, `data` or
    `make_strategy` (imported on first use)."""
    names = dir(distrib_tf)
    assert {"Run", "data", "make_strategy", "Preempted", "NonFiniteLoss", "InvalidRun", "__version__"} <= set(names)
    assert not {"importlib", "logging"} & set(names), names


def test_every_public_name_resolves_and_has_a_docstring():
    for name in distrib_tf.__all__:
        value = getattr(distrib_tf, name)
        assert inspect.getdoc(value), f"distrib_tf.{name} has no docstring"


def test_the_version_is_the_packages_and_a_bare_import_needs_no_tensorflow():
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    assert parser["metadata"]["version"] == "attr: distrib_tf.__version__"
    assert distrib_tf.__version__.count(".") == 2 and os.path.exists(os.path.join(ROOT, "LICENSE"))
    code = "import sys, distrib_tf; dir(distrib_tf); distrib_tf.ClusterSpec; print('tensorflow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.stdout.strip() == "False", done.stderr[-2000:]  # The launcher's side stays light.
