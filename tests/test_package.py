"""The package's public surface: what `import distrib_tf` shows, documents and ships."""

import configparser
import inspect
import os
import re
import subprocess
import sys

import pytest

import distrib_tf
from distrib_tf import versions

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


def _import_with_tensorflow_metadata(tmp_path, version, code="import distrib_tf"):
    """`code` run where the installed TensorFlow's package metadata says `version`."""
    dist_info = tmp_path / f"tensorflow-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorflow\nVersion: {version}\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})


def test_the_tested_tensorflow_range_is_setup_cfgs():
    """The range the warning names is the one setup.cfg declares (`tensorflow>=2.18,<2.22`: 2.21 inclusive)."""
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    required, = [r for r in parser["options"]["install_requires"].split("\n") if r.startswith("tensorflow")]
    low_major, low_minor, high_major, high_minor = map(int, re.fullmatch(
        r"tensorflow>=(\d+)\.(\d+),<(\d+)\.(\d+)", required).groups())
    assert versions.TESTED_TENSORFLOW == ((low_major, low_minor), (high_major, high_minor - 1)), required
    cuda, = [r for r in parser["options.extras_require"]["cuda"].split("\n") if r]
    assert cuda == required.replace("tensorflow", "tensorflow[and-cuda]"), cuda


@pytest.mark.parametrize("version", ["2.17.1", "2.22.0rc0", "3.0.0"])
def test_an_untested_tensorflow_gets_one_warning_at_import(tmp_path, version):
    """Issue 54: outside the tested range, `import distrib_tf` warns in one line naming the range,
    and goes on (a warning, not an error); TensorFlow itself is not imported for it."""
    code = "import sys, distrib_tf; print('tensorflow' in sys.modules)"
    done = _import_with_tensorflow_metadata(tmp_path, version, code)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"<string>:1: UntestedVersionWarning: TensorFlow {re.escape(version)} is not a version "
                        rf"distrib_tf is tested with \(2\.18 to 2\.21\): .*", lines[0]), lines


@pytest.mark.parametrize("version", ["2.18.0", "2.19.1", "2.20.0", "2.21.0"])
def test_a_tested_tensorflow_imports_without_a_word(tmp_path, version):
    done = _import_with_tensorflow_metadata(tmp_path, version)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]


def test_the_warning_points_at_the_users_import_and_can_be_silenced(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text("import os\nimport distrib_tf.cluster\n")
    done = _import_with_tensorflow_metadata(tmp_path, "2.17.1", f"import runpy; runpy.run_path({str(script)!r})")
    assert done.stderr.startswith(f"{script}:2: UntestedVersionWarning: TensorFlow 2.17.1 "), done.stderr
    silenced = _import_with_tensorflow_metadata(
        tmp_path, "2.17.1", "import warnings; warnings.simplefilter('ignore', UserWarning); import distrib_tf")
    assert silenced.returncode == 0 and silenced.stderr == "", silenced.stderr


def test_the_installed_tensorflow_is_tested_and_imports_without_a_word():
    """What `make test` and each venv of `make test-tf` run on is inside the range, and says nothing."""
    version = versions.tensorflow_version()
    assert version and versions.is_tested(version), version
    done = subprocess.run([sys.executable, "-c", "import distrib_tf"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
