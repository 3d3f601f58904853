"""The package's public surface: what `import distrib_tf` shows, documents and ships."""

import configparser
import inspect
import os
import subprocess
import sys

import pytest

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


def test_every_console_scripts_help_exits_0_and_gives_each_flag_its_text():
    """Issue 45: `distrib-tf-train --help` exited 1 with absl's two lines; `distrib-tf-ray --help`
    gave three flags no text or default."""
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    scripts = dict(line.split(" = ") for line in parser["options.entry_points"]["console_scripts"].split("\n") if line)
    expected = {"distrib-tf-train": "--epochs: Epochs to train.", "distrib-tf-ray": "failure (default: 3)",
                "distrib-tf-sweep": "--pruner", "distrib-tf-launch": "--grace_period",
                "distrib-tf-export": "kubernetes"}
    assert set(scripts) == set(expected)
    for name, target in scripts.items():
        module, function = target.split(":")
        code = f"import sys; from {module} import {function} as main; sys.argv = [{name!r}, '--help']; sys.exit(main())"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert done.returncode == 0, (name, done.stdout[-500:], done.stderr[-1000:])
        assert done.stdout.startswith(f"usage: {name}") and expected[name] in done.stdout, (name, done.stdout)


@pytest.mark.slow  # A fresh venv and TensorFlow's wheel: minutes.
def test_a_core_install_runs_without_the_test_tools_or_tfds(tmp_path):
    """`pip install .` into a fresh venv: `distrib_tf.Run` works, and pytest, ruff, optuna and
    tensorflow-datasets are not there (they are extras)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run([python, "-m", "pip", "install", "--quiet", ROOT], capture_output=True, text=True,
                               timeout=1200, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    code = ("import importlib.util, distrib_tf; distrib_tf.Run; distrib_tf.data.from_arrays; "
            "extras = ('pytest', 'ruff', 'optuna', 'tensorflow_datasets'); "
            "print(sorted(m for m in extras if importlib.util.find_spec(m)))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-3000:])
