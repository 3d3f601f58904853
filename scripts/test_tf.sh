#!/usr/bin/env bash
# `make test-tf`: distrib_tf on every TensorFlow minor that setup.cfg declares but .venv's
# own (which `make test` runs), each in a venv of its own under .tf/: TensorFlow of that
# minor, the Keras pip resolves with it inside setup.cfg's range, and the project with its
# test extra, all installed from the project's files (pip's cache is .tf/pip-cache, in the clone).
# On each: the Keras fixes at work (whether each is needed: on the newest only), a keras.io
# example on 2 workers preempted inside an epoch and resumed bit-identical, `make train`'s
# command (the launcher on cluster_specs/local_2workers.json, its output filtered of
# TensorFlow's log lines), and the launcher filter's and the version check's own tests.
# Prints each minor's minutes.
#   scripts/test_tf.sh [PYTEST_ARGS...]
#   DISTRIB_TF_TF_MINORS="19 20" scripts/test_tf.sh   # some of them only
#   DISTRIB_TF_MINORS=oldest scripts/test_tf.sh      # the oldest only (CI); =others: the rest
#   DISTRIB_TF_INSTALL_ONLY=1 scripts/test_tf.sh      # their venvs only, no test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
minors=$("$PYTHON" - <<'PY'
import configparser, re
config = configparser.ConfigParser()
config.read("setup.cfg")
requirement = next(r for r in config["options"]["install_requires"].split("\n") if r.startswith("tensorflow"))
low, high = re.fullmatch(r"tensorflow>=2\.(\d+),<2\.(\d+)", requirement.strip()).groups()
print(" ".join(str(m) for m in range(int(low), int(high))))
PY
)
# .venv's own TensorFlow minor is the one `make test` runs everything on.
base_minor=$(TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/python -c 'import tensorflow as tf; print(tf.__version__.split(".")[1])' 2>/dev/null || true)
source scripts/minors.sh
minors=$(pick_minors "$minors")
minors=${DISTRIB_TF_TF_MINORS:-$minors}
# Lean, for CI's budget: the Keras fixes at work but the slow tests (make soak: among them the
# kill-and-resume one). Not "each fix is needed": whether upstream still fails without a fix is
# asked of the newest TensorFlow, which `make test` runs (it tells when a fix can go); under an
# older one the fix stays either way (as scripts/test_compat.sh does for Keras's minors).
tests=(
  -m "not slow"
  tests/test_keras_compat.py --deselect tests/test_keras_compat.py::test_each_fix_is_needed
  "tests/test_examples.py::test_a_keras_io_script_preempted_inside_an_epoch_ends_on_the_uninterrupted_weights[mnist_convnet]"
  tests/test_launch.py::test_two_workers_train_through_the_launcher_one_speaks_and_every_event_streams
  tests/test_progress.py::test_quiet_drops_tensorflows_cuda_factory_lines_at_import
  tests/test_package.py::test_the_installed_tensorflow_is_tested_and_imports_without_a_word
  tests/test_package.py::test_an_untested_tensorflow_gets_one_warning_at_import
)
# One pip cache for the minors, inside the clone: their test tools are downloaded once.
export PIP_CACHE_DIR="$PWD/.tf/pip-cache"
failed=()
passed=()
for minor in $minors; do
  if [ "$minor" = "$base_minor" ]; then
    echo "== TensorFlow 2.$minor: .venv's own, run by make test"
    continue
  fi
  start=$SECONDS
  env=".tf/tf-2.$minor"
  if [ ! -f "$env/.installed" ]; then
    rm -rf "$env"
    "$PYTHON" -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip
    "$env/bin/python" -m pip install --quiet "tensorflow==2.$minor.*" -e '.[test]'
    touch "$env/.installed"
  fi
  installed=$(( SECONDS - start ))
  if [ -n "${DISTRIB_TF_INSTALL_ONLY:-}" ]; then  # .ci/run installs them beside make test.
    echo "== test-tf: .tf/tf-2.$minor installed in $installed s"
    continue
  fi
  versions=$(TF_CPP_MIN_LOG_LEVEL=3 "$env/bin/python" -c '
import importlib.util, keras, tensorflow as tf
assert importlib.util.find_spec("tf_keras") is None, "tf_keras is installed"
print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}")' 2>/dev/null)
  echo "== $versions ($env, installed in $installed s)"
  # `pip install -e .` over this TensorFlow keeps it (it replaced 2.19 by 2.21 when setup.cfg held 2.21 only).
  replaced=$("$env/bin/python" -m pip install --dry-run --quiet --no-cache-dir --report - -e . 2>/dev/null |
    "$env/bin/python" -c 'import json, sys; print(" ".join(i["metadata"]["name"] for i in json.load(sys.stdin)["install"] if i["metadata"]["name"] != "distrib_tf"))')
  if [ -n "$replaced" ]; then
    echo "test-tf: pip install -e . would replace $replaced under $versions" >&2
    failed+=("$versions (pip install -e . replaces $replaced)")
    continue
  fi
  if PYTHONPATH="$PWD" "$env/bin/python" -m pytest -q -p no:cacheprovider --durations=5 -n 2 --dist loadfile "${tests[@]}" "$@"; then
    passed+=("2.$minor")
  else
    failed+=("$versions")
  fi
  echo "== test-tf: $versions took $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s (install $installed s)"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test-tf: failed with ${failed[*]}" >&2
  exit 1
fi
echo "test-tf: passed with TensorFlow ${passed[*]}"
