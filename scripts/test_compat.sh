#!/usr/bin/env bash
# `make test-compat`: the Keras compat fixes at work once per Keras minor that setup.cfg
# declares (but .venv's own, which `make test` runs), and multi-worker training tests on the
# oldest, each in an environment of its own. Each is a venv holding its own Keras, the newest
# release of that minor; TensorFlow, the test tools and distrib_tf come from .venv
# through a .pth file (its own Keras comes first on sys.path).
#   scripts/test_compat.sh [PYTEST_ARGS...]
#   DISTRIB_TF_MINORS=oldest scripts/test_compat.sh   # the oldest minor only (CI); =others: the rest
set -euo pipefail
cd "$(dirname "$0")/.."
base=.venv
base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
minors=$("$base/bin/python" - <<'PY'
import configparser, re
config = configparser.ConfigParser()
config.read("setup.cfg")
requirement = next(r for r in config["options"]["install_requires"].split("\n") if r.startswith("keras"))
low, high = re.fullmatch(r"keras>=3\.(\d+),<3\.(\d+)", requirement.strip()).groups()
print(" ".join(str(m) for m in range(int(low), int(high))))
PY
)
# .venv's own Keras minor is covered by `make test`, which runs the same tests with it.
base_minor=$(TF_CPP_MIN_LOG_LEVEL=3 "$base/bin/python" -c 'import keras; print(keras.__version__.split(".")[1])' 2>/dev/null)
# Every minor: the compat fixes at work (2 workers matching one process through them, and
# each fix's own case), the step's ops, and the run API with a user's model of two inputs
# and two outputs: the paths that reach into Keras's private modules. Not "each fix is
# needed": whether Keras still fails without a fix is asked of the newest Keras, which
# `make test` runs (it tells when a fix can go); under an older one the fix stays either way.
tests=(
  tests/test_keras_compat.py --deselect tests/test_keras_compat.py::test_each_fix_is_needed
  tests/test_step.py
  tests/test_run_api.py
)
# The oldest minor also: multi-worker training through them, as users run it: the main job
# on 2 workers, periodic sync, a NaN stop, a preemption in validation, a rollback under a
# schedule. (All minors ran these until CI's time went over its hour; the oldest is the
# furthest from .venv's, which `make test` runs them with.)
oldest_tests=(
  tests/test_train.py::test_two_workers_write_one_summary
  tests/test_localsgd.py::test_workers_hold_identical_weights_after_each_sync_and_differ_between
  tests/test_nonfinite.py::test_one_workers_inf_stops_every_worker_at_the_same_step
  "tests/test_preemption.py::test_sigterm_outside_training_batches_exits_75_and_the_job_resumes[validation]"
  tests/test_run.py::test_rollback_under_a_schedule_goes_on_and_survives_a_restart
)
oldest=${minors%% *}
source scripts/minors.sh
minors=$(pick_minors "$minors")
failed=()
for minor in $minors; do
  if [ "$minor" = "$base_minor" ]; then
    echo "== Keras 3.$minor: .venv's own, run by make test"
    continue
  fi
  env=".compat/keras-3.$minor"
  if [ ! -f "$env/.installed" ]; then
    rm -rf "$env"
    "$base/bin/python" -m venv --without-pip "$env"
    site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$base/bin/python" -m pip install --quiet --no-deps --target "$site" "keras==3.$minor.*"
    echo "$base_site" > "$site/distrib_tf_base.pth"
    touch "$env/.installed"
  fi
  version=$(TF_CPP_MIN_LOG_LEVEL=3 "$env/bin/python" -c 'import keras; print(keras.__version__)' 2>/dev/null)
  echo "== Keras $version ($env)"
  chosen=("${tests[@]}")
  if [ "$minor" = "$oldest" ]; then
    chosen+=("${oldest_tests[@]}")
  fi
  if ! PYTHONPATH="$PWD" "$env/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "${chosen[@]}" "$@"; then
    failed+=("$version")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test-compat: failed with Keras ${failed[*]}" >&2
  exit 1
fi
echo "test-compat: passed with Keras 3.$(echo "$minors" | sed 's/ /, 3./g')"
