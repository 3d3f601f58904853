"""Sweeps whose study is in PostgreSQL or a journal file: the pruning word through the study,
a SIGKILLed sweep picked up from the database, bad storage refused; trials side by side on
disjoint local ranks, never two runs of the same values, a second fit pruned at its epochs.

PostgreSQL is started here, on a free port in a scratch directory (Debian's `postgresql`:
`initdb` and `pg_ctl`, as the `postgres` user when run as root). Without it the PostgreSQL
tests skip, except when DISTRIB_TF_REQUIRE_POSTGRES=1 (CI), where they fail.
"""

import csv
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

import postgres as postgres_lib
from cluster_runner import QUIET_TF
from distrib_tf import events
from distrib_tf.experiments import sweep
from distrib_tf.experiments import sweep_space

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
SPEC = os.path.join(ROOT, "cluster_specs", "local_2workers.json")
SWEEP = "distrib_tf.experiments.sweep"
SCRIPT = os.path.join(ROOT, "tests", "workers", "swept_script.py")
ONE_WORKER = [f"--cluster_spec={SPEC}", "--workers_per_trial=1"]


def _need_postgres(why: str):
    if os.environ.get("DISTRIB_TF_REQUIRE_POSTGRES") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of this module's own: its URL (user postgres, no password)."""
    try:
        with postgres_lib.server() as url:
            yield url
    except postgres_lib.Unavailable as e:
        _need_postgres(str(e))


def _sweep(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", SWEEP, *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT)


def _rows(sweep_dir) -> list[dict]:
    with open(os.path.join(sweep_dir, "results.csv"), encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _study(sweep_dir, url, name, names="learning_rate=[0.05,0.0]"):
    return sweep.open_study(str(sweep_dir), sweep_space.parse_space(names, kinds=None), sampler="grid", seed=0,
                            mode="min", storage=url, study_name=name)


def _first_trial_events(sweep_dir, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while not (found := glob.glob(os.path.join(sweep_dir, "trial-*", "events.jsonl"))):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return found[0]


@pytest.mark.parametrize("storage, message", [
    ("mysql://me@db/sweeps", "Received: 'mysql://me@db/sweeps'. Expected sqlite:///PATH, "
                             "postgresql+psycopg://USER@HOST:PORT/DATABASE or journal:PATH."),
    ("sqlite://", "Received: 'sqlite://'. Expected sqlite:///PATH"),
    ("journal:/nonexistent/dir/study.log", "a disk every host shares (no directory /nonexistent/dir)"),
    ("postgresql+psycopg://me:secret@127.0.0.1/", "Expected postgresql+psycopg://USER@HOST:PORT/DATABASE, with a "
                                                  "host and a database"),
    ("postgresql+psycopg://me:secret@127.0.0.1:{closed}/sweeps",
     "Cannot open the study for `--storage`. Received: postgresql+psycopg://me:***@127.0.0.1:"),
])
def test_bad_storage_exits_2_in_one_line_and_starts_nothing(tmp_path, storage, message):
    storage = storage.format(closed=postgres_lib.free_port())  # Nothing listens there: a server that does not answer.
    started = time.monotonic()
    result = _sweep(f"--sweep_dir={tmp_path}/sweep", f"--storage={storage}", "--space=units=[4]", *ONE_WORKER,
                    "--", "python", SCRIPT, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "Invalid value for `--storage`" in result.stderr or "Cannot open the study for `--storage`" in result.stderr
    assert "secret" not in result.stderr  # The password is not shown.
    assert time.monotonic() - started < 40  # A bounded wait.
    assert not (tmp_path / "sweep").exists()


def test_a_study_of_another_script_is_refused_and_kept(tmp_path):
    url = f"journal:{tmp_path}/study.log"
    space = sweep_space.parse_space("units=[4,8]", kinds=None)
    other = sweep.open_study(str(tmp_path), space, sampler="grid", seed=0, mode="min", storage=url,
                             program="/home/me/other.py")
    other.tell(sweep.ask_new(other, space, "grid"), 0.5)
    result = _sweep(f"--sweep_dir={tmp_path}/sweep", f"--storage={url}", "--space=units=[4,8]", *ONE_WORKER,
                    "--", "python", SCRIPT, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and (
        f"Invalid value for `--storage`. Received: {url}, whose study 'distrib_tf' sweeps ['units'] of "
        f"/home/me/other.py. Expected a study of this sweep (['units'] of {SCRIPT}): another --study_name or "
        "--storage.") in result.stderr, result.stderr
    kept = _study(tmp_path, url, "distrib_tf", "units=[4,8]")
    assert [(t.state.name, t.value, t.params) for t in kept.trials] == [("COMPLETE", 0.5, {"units": 4})]


def test_a_study_with_a_job_of_another_engine_running_is_refused_and_kept(tmp_path):
    """A sweep on the local engine (the default) started on a study whose trial runs as a
    Slurm job would have told that trial failed and trained its values again beside the job.
    It is refused in one line naming the trial, the job and the engine that follows it; the
    trial stays running."""
    url = f"journal:{tmp_path}/study.log"
    space = sweep_space.parse_space("units=[4,8]", kinds=None)
    study = sweep.open_study(str(tmp_path), space, sampler="grid", seed=0, mode="min", storage=url,
                             program=SCRIPT)
    trial = sweep.ask_new(study, space, "grid")
    trial.set_user_attr("job", "slurm:4242")
    result = _sweep(f"--sweep_dir={tmp_path}/sweep", f"--storage={url}", "--space=units=[4,8]", *ONE_WORKER,
                    "--", "python", SCRIPT, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and (
        f"Invalid value for `--engine`. Received: local, while trial 0 of the study 'distrib_tf' in {url} runs as "
        "slurm job 4242. Expected --engine=slurm, which follows that job to its end") in result.stderr, result.stderr
    kept = _study(tmp_path, url, "distrib_tf", "units=[4,8]")
    assert [(t.state.name, t.user_attrs) for t in kept.trials] == [("RUNNING", {"job": "slurm:4242"})]


@pytest.mark.multiworker
# make soak: the journal file. make test: the same sweep, kill and resume on PostgreSQL, and on SQLite in
# tests/test_sweep.py; a journal study written, refused and read again (above); make test-ray sweeps on one.
@pytest.mark.parametrize("kind", ["postgresql", pytest.param("journal", marks=pytest.mark.slow)])
def test_a_sweep_in_a_database_sigkilled_resumes_and_prunes_through_the_study(tmp_path, request, kind):
    """Trial 0 learns; the sweep is SIGKILLed in its second epoch and started again at once.
    Trial 0 resumes first, at its step, once the killed sweep's launcher has backed up and
    stopped; then the grid goes on in its order (0.001, then 0.0, which the median of the
    trial that ended prunes after their first epoch by the word the sweep wrote into the study)."""
    url = request.getfixturevalue("postgres") if kind == "postgresql" else f"journal:{tmp_path}/study.log"
    name = f"killed_{kind}"
    args = [f"--sweep_dir={tmp_path}/sweep", f"--storage={url}", f"--study_name={name}",
            "--space=learning_rate=[0.05,0.001,0.0]", "--pruner=median", "--pruner_startup_trials=1",
            "--metric=val_loss", "--mode=min", *ONE_WORKER, "--parallel=1", "--", "python", SCRIPT, "--epochs=3",
            "--slow=0.05"]
    killed = subprocess.Popen([sys.executable, "-m", SWEEP, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    first = _first_trial_events(tmp_path / "sweep")
    follower, deadline, step = events.Follower(first), time.monotonic() + 120, 0
    while step < 22:  # In epoch 2 (16 steps an epoch), past its backup of step 20.
        assert time.monotonic() < deadline and killed.poll() is None
        step = max([e["step"] + 16 * (e["epoch"] - 1) for e in follower() if e["event"] == "progress"] + [step])
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()

    again = _sweep(*args)  # At once: its launcher got SIGTERM and is backing up, the new one waits.
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"study '{name}' in {url}" in again.stdout
    assert not (tmp_path / "sweep" / "study.db").exists()  # The study is where --storage says.
    rows = {float(r["learning_rate"]): r for r in _rows(tmp_path / "sweep")}
    assert {k: r["status"] for k, r in rows.items()} == {0.05: "finished", 0.001: "pruned", 0.0: "pruned"}, (
        again.stdout)
    assert again.stdout.index("{'learning_rate': 0.05}: resumed") < again.stdout.index("{'learning_rate': 0.001}")
    log = _text(os.path.join(rows[0.05]["model_dir"], "trial.log"))
    resumed_at = [int(line.split("resumes at step ")[1].split()[0]) for line in log.splitlines()
                  if "resumes at step" in line]
    assert len(resumed_at) == 1 and resumed_at[0] >= 20, log  # At its step, not from 0, and once.
    ends = [e["exit_code"] for e in events.read(first) if e["event"] == "job_end"]
    assert ends == [75, 0], (ends, log)  # Backed up, then resumed to the end: never two runs at once.
    if kind == "postgresql":  # Its chief reaches the database: the host's network, not a private one.
        assert "--network=host" in log
    assert "pruned by the sweep after epoch 1" in _text(os.path.join(rows[0.0]["model_dir"], "trial.log"))
    study = _study(tmp_path, url, name, "learning_rate=[0.05,0.001,0.0]")
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "FAIL", "PRUNED", "PRUNED"]  # None twice.
    assert not [t for t in study.trials if "cause" in t.user_attrs]  # The killed attempt: interrupted.
    for pruned in [t for t in study.trials if t.state.name == "PRUNED"]:
        assert pruned.user_attrs["prune:1:1"] == "prune" and sorted(pruned.intermediate_values) == [1]


@pytest.mark.multiworker
def test_the_same_values_drawn_twice_at_once_run_once(tmp_path):
    """A sampler that hands two running trials the same values: one run, one directory."""
    result = _sweep(f"--sweep_dir={tmp_path}", "--space=units=[8]", "--sampler=random", "--trials=2", *ONE_WORKER,
                    "--metric=val_loss", "--mode=min", "--", "python", SCRIPT, "--epochs=1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 at a time" in result.stdout and result.stdout.count(": started in") == 1, result.stdout
    assert "trial 1 {'units': 8}: the same as trial 0, which runs; waits for its result" in result.stdout
    assert "trial 1 {'units': 8}: the same as trial 0, not run again" in result.stdout
    assert len(glob.glob(os.path.join(tmp_path, "trial-*"))) == 1
    assert [r["status"] for r in _rows(tmp_path)] == ["finished"]


@pytest.mark.multiworker
def test_a_second_fit_is_reported_and_pruned_at_its_own_epochs(tmp_path):
    """Fit 1 has one epoch, fit 2 two: the pruner (warm for 2 reports) prunes the learning rate
    of 0 at fit 2's first epoch, the third report in all for the trial that finishes."""
    result = _sweep(f"--sweep_dir={tmp_path}", "--space=learning_rate=[0.05,0.0]", "--pruner=median",
                    "--pruner_startup_trials=1", "--pruner_warmup_epochs=2", "--metric=val_loss", "--mode=min",
                    *ONE_WORKER, "--parallel=1", "--", "python", SCRIPT, "--epochs=1", "--second_fit=2")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {float(r["learning_rate"]): r for r in _rows(tmp_path)}
    assert {k: (r["status"], r["epochs"]) for k, r in rows.items()} == {
        0.05: ("finished", "3"), 0.0: ("pruned", "2")}, result.stdout
    assert "trial 0 fit 2 epoch 2/2: val_loss" in result.stdout
    assert "trial 1: pruned after fit 2 epoch 1" in result.stdout
    assert "pruned by the sweep after epoch 1" in _text(os.path.join(rows[0.0]["model_dir"], "trial.log"))
    study = _study(tmp_path, None, "distrib_tf")
    pruned, = [t for t in study.trials if t.state.name == "PRUNED"]
    assert (pruned.user_attrs["prune:1:1"], pruned.user_attrs["prune:2:1"]) == ("go", "prune")
    assert sorted(pruned.intermediate_values) == [1, 2]
