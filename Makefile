# Every target bootstraps its own virtual environment in .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VENV_RAY := .venv-ray
STAMP_RAY := $(VENV_RAY)/.installed

.PHONY: install install-suites docs train test test-fast test-compat test-keras test-tf test-ray test-engines soak bench bench-data bench-layout bench-scaling bench-sync bench-overhead bench-resize bench-backup lint clean

# One line says what is installed; pip prints its errors only (-qq). `make train` installs the
# library and TensorFlow (.venv/.installed-run); the test targets add the test tools and keras-hub.
STAMP_RUN := $(VENV)/.installed-run
$(STAMP_RUN): setup.cfg pyproject.toml
	@echo "make: installing distrib_tf with TensorFlow into $(VENV) (pip's errors only)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -e .
	@touch $(STAMP_RUN)

$(STAMP): setup.cfg pyproject.toml
	@echo "make: installing distrib_tf with TensorFlow, the test tools and keras-hub into $(VENV) (pip's errors only)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -e '.[test,hub]'
	@touch $(STAMP_RUN) $(STAMP)

install: $(STAMP)

STAMP_DOCS := $(VENV)/.installed-docs
$(STAMP_DOCS): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(STAMP_DOCS)

# The documentation site in site/ (MkDocs, Material, mkdocstrings: mkdocs.yml), warnings as errors.
docs: $(STAMP_DOCS)
	mkdir -p docs/benchmarks && cp benchmarks/*.png docs/benchmarks/
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

train: $(STAMP_RUN)
	$(PY) -m distrib_tf.launch --cluster_spec=cluster_specs/local_2workers.json \
	    -- $(PY) -m distrib_tf.train --model=cnn --model_dir=runs/cnn

# Two test files at a time (pytest-xdist, a file's tests on one process, in order): most tests
# wait on TensorFlow's start-up and on their workers' processes, which the other file's fill.
test: $(STAMP)
	$(PY) -m pytest -q --durations=40 -n 2 --dist loadfile -m "not slow and not engines"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multiworker and not slow and not engines"

# The Keras compat tests once per Keras minor that setup.cfg declares (but .venv's own), each
# in its own venv; multi-worker training tests on the oldest (scripts/test_compat.sh).
# MINORS=oldest: the oldest minor only (.ci/run); MINORS=others: the rest (make soak).
MINORS ?= all
test-compat: $(STAMP)
	DISTRIB_TF_MINORS=$(MINORS) scripts/test_compat.sh -k "not killed_run"

# Keras's own tests of fit (its trainer, callbacks and models, from the installed Keras's sdist)
# plainly and with a live distrib_tf.Run, on one device and on 2 replicas: fails on a test only
# the run fails, unless tests/keras_contract/refusals.txt lists it (tests/keras_contract/contract.py).
# KERAS_LAYOUTS=one runs the one-device pair only.
KERAS_LAYOUTS ?= one,two
test-keras: $(STAMP)
	$(PY) tests/keras_contract/contract.py --layouts=$(KERAS_LAYOUTS)

# Each TensorFlow minor that setup.cfg declares (but .venv's own, which make test runs), in a venv
# of its own under .tf/: the Keras fixes, a keras.io example preempted and resumed on 2 workers,
# and make train's command through the launcher (scripts/test_tf.sh).
test-tf: $(STAMP)
	DISTRIB_TF_MINORS=$(MINORS) scripts/test_tf.sh

# Ray Train on a two-node local Ray cluster (as root), in a venv of its own with the `ray` extra;
# a sweep whose trials are Ray jobs (tests/test_ray.py).
$(STAMP_RAY): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV_RAY)
	$(VENV_RAY)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_RAY)/bin/python -m pip install --quiet -e '.[test,ray]'
	touch $(STAMP_RAY)

# The venvs of test-tf and test-ray alone, no test: .ci/run installs them while make test runs.
install-suites: $(STAMP) $(STAMP_RAY)
	DISTRIB_TF_MINORS=$(MINORS) DISTRIB_TF_INSTALL_ONLY=1 scripts/test_tf.sh

# (Tasks as new interpreters, not forks: the tests find them in /proc by their command lines.)
test-ray: $(STAMP_RAY)
	DISTRIB_TF_FORKSERVER= DISTRIB_TF_REQUIRE_RAY=1 $(VENV_RAY)/bin/python -m pytest -q --durations=5 tests/test_ray.py

# As root: the Kubernetes exports' pods as local processes, each engine's restart rules
# played on them (tests/test_engines.py): a killed pod, a preemption, a bad flag, a sweep whose
# trials are Jobs applied through a `kubectl` that plays the API (tests/kubectl.py); on a two-node
# Slurm, a resize and a sweep whose trials are batch jobs, the study in PostgreSQL (tests/test_slurm.py).
# Tasks as new interpreters (not forks of the suite's server): under srun and in the pods, as users run them.
test-engines: $(STAMP)
	DISTRIB_TF_FORKSERVER= $(PY) -m pytest -q --durations=5 -m engines tests/test_engines.py tests/test_slurm.py

# The long variants, two test files at a time as make test (each test's report is its own file
# beside soak_report.json); then the Keras and TensorFlow minors between the oldest (.ci/run's)
# and .venv's (make test's).
soak: $(STAMP)
	DISTRIB_TF_SOAK_REPORT=$(CURDIR)/soak_report.json $(PY) -m pytest -q -rfE --durations=25 -n 2 --dist loadfile -m slow
	$(MAKE) test-compat test-tf MINORS=others

bench: $(STAMP)
	$(PY) benchmarks/run.py

# The input pipeline at 1 and 4 GiB on 2 workers, against plain TFRecord, and the Grain route (benchmarks/data.py).
bench-data: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/data.py --grain

# How far apart layouts end, in float32 and float64 (benchmarks/layout_gap.py).
bench-layout: $(STAMP)
	$(PY) benchmarks/layout_gap.py

# As root: two simulated hosts, a shaped link, pinned cores (benchmarks/scaling.py).
bench-scaling: $(STAMP)
	$(PY) benchmarks/scaling.py

# As root: periodic sync and compressed all-reduce on shaped links (benchmarks/sync.py).
bench-sync: $(STAMP)
	$(PY) benchmarks/sync.py

# What each of our per-step additions costs, switched off one at a time (benchmarks/overhead.py).
bench-overhead: $(STAMP)
	$(PY) benchmarks/overhead.py

# From a restart to the first step: a resize (2 -> 1, 2 -> 3) against a restart on the new layout (benchmarks/resize.py).
bench-resize: $(STAMP)
	$(PY) benchmarks/resize.py

# Backups of a 34.6 M-parameter model every 5 steps against epoch ends only, in the background and not (benchmarks/backups.py).
bench-backup: $(STAMP)
	$(PY) benchmarks/backups.py

lint: $(STAMP)
	$(PY) -m ruff check distrib_tf tests benchmarks
	$(VENV)/bin/lint-imports --no-logo

clean:
	rm -rf $(VENV) .compat .keras-contract .tf build *.egg-info
