"""Sweeps: a small grid of real 2-worker trials, a failing trial, re-runs, bad input."""

import json
import os
import subprocess
import sys

import pytest

from cluster_runner import QUIET_TF
from distrib_tf.experiments import sweep

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
SPEC = os.path.join(ROOT, "cluster_specs", "local_2workers.json")
SWEEP = "distrib_tf.experiments.sweep"


def _sweep(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", SWEEP, f"--cluster_spec={SPEC}", *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)


@pytest.mark.multiworker
@pytest.mark.slow  # 40 to 83 s; the TPE and side-by-side sweeps run in make test.
def test_grid_of_two_worker_trials_with_a_failure_then_a_rerun(tmp_path):
    args = ["--space=learning_rate=[1e-3,3e-3] global_batch_size=[64,63]", f"--sweep_dir={tmp_path}",
            "--", "--epochs=2", "--steps_per_epoch=10"]
    first = _sweep(*args)
    assert first.returncode == 1, first.stdout + first.stderr  # One value of the grid cannot run.
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 4
    finished = [r for r in rows if r["status"] == "finished"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(finished) == 2 and len(failed) == 2
    assert all(r["global_batch_size"] == 63 for r in failed)
    assert all("Expected a multiple of the 2 replicas" in r["cause"] for r in failed)
    assert rows[0]["best_val_accuracy"] >= rows[1]["best_val_accuracy"]  # Sorted by the metric.
    for r in finished:
        summary = json.loads((tmp_path / os.path.basename(r["model_dir"]) / "summary.json").read_text())
        assert summary["workers"] == 2 and summary["config"]["learning_rate"] == r["learning_rate"]
    assert (tmp_path / "results.csv").read_text().startswith("trial,learning_rate,global_batch_size,status")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert "| best_val_accuracy |" in first.stdout

    assert "Expected a multiple of the 2 replicas" in failed[0]["cause"]
    study = sweep.open_study(str(tmp_path), sweep.parse_space("learning_rate=[1e-3,3e-3] global_batch_size=[64,63]"),
                             sampler="grid", seed=0, mode="max")
    states = sorted(t.state.name for t in study.trials)
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "FAIL"]
    assert all("Expected a multiple" in t.user_attrs["cause"] for t in study.trials if t.state.name == "FAIL")
    assert study.best_value == rows[0]["best_val_accuracy"]

    again = _sweep(*args)
    assert again.stdout.count("finished before, skipped") == 2
    assert again.stdout.count(": started") == 2  # Only the failed ones run again.
    assert len(json.loads((tmp_path / "results.json").read_text())) == 4


def _asked(tmp_path, space, sampler, count, seed=0, mode="max"):
    tmp_path.mkdir(exist_ok=True)
    study = sweep.open_study(str(tmp_path), space, sampler=sampler, seed=seed, mode=mode)
    asked = [study.ask() for _ in range(count)]
    return study, asked, [sweep.suggest(trial, space) for trial in asked]


def test_space_parsing_and_optuna_sampling(tmp_path):
    space = sweep.parse_space("learning_rate=logspace(1e-4,1e-2,3) global_batch_size=[32,64]")
    assert [round(v, 6) for v in space[0].values] == [0.0001, 0.001, 0.01]
    assert sweep.grid_size(space) == 6
    _, _, grid = _asked(tmp_path / "grid", space, "grid", 6)
    assert sorted((v["learning_rate"], v["global_batch_size"]) for v in grid) == sorted(
        (lr, b) for lr in space[0].values for b in (32, 64))  # Every point once.
    ranged = sweep.parse_space(data={"learning_rate": {"loguniform": [1e-4, 1e-2]}, "seed": [1, 2]})
    _, _, draws = _asked(tmp_path / "a", ranged, "random", 20, seed=3)
    assert all(1e-4 <= d["learning_rate"] <= 1e-2 and d["seed"] in (1, 2) for d in draws)
    assert draws == _asked(tmp_path / "b", ranged, "random", 20, seed=3)[2]
    # A range of an integer flag draws integers (floats made every trial fail on the flag).
    integers = sweep.parse_space("epochs=uniform(1,4) steps_per_epoch=loguniform(2,64)")
    _, _, draws = _asked(tmp_path / "c", integers, "random", 10, seed=1)
    assert all(type(d["epochs"]) is int and 1 <= d["epochs"] <= 4 for d in draws), draws
    assert all(type(d["steps_per_epoch"]) is int for d in draws), draws
    with pytest.raises(ValueError, match=r"Received: '1.5'\. Expected an integer"):
        sweep.parse_space("epochs=uniform(1.5,4)")


def test_min_mode_and_a_zero_metric_reach_optuna(tmp_path):
    """The study minimizes with --mode=min, and 0.0 is recorded as a value, not a failure."""
    space = sweep.parse_space("learning_rate=[0.1,0.2]")
    study, asked, _ = _asked(tmp_path, space, "grid", 2, mode="min")
    study.tell(asked[0], 0.0)
    study.tell(asked[1], 0.5)
    assert study.direction.name == "MINIMIZE" and study.best_value == 0.0
    assert sweep.open_study(str(tmp_path), space, sampler="grid", seed=0, mode="min").best_value == 0.0


@pytest.mark.parametrize("args, message", [
    (["--space=lr=[1,2]"], "Invalid flag `lr` in the search space. Expected one of"),
    (["--space="], "Empty search space."),
    (["--space=learning_rate=[]"], "Expected at least one value"),
    (["--space=learning_rate=linspace(1,0,3)"], "Received: 'linspace(1,0,3)'. Expected a < b."),
    (["--space=learning_rate=linspace(0.1,1)"], "Expected linspace(a,b,n)."),
    (["--space=learning_rate=loguniform(0,1)", "--sampler=random", "--trials=2"], "a > 0 on a log scale"),
    (["--space=learning_rate=loguniform(1e-4,1e-2)"], "Invalid search space for --sampler=grid"),
    (["--space=learning_rate=[1e-3]", "--trials=0"], "Invalid value for `--trials`. Received: 0."),
    (["--space=learning_rate=[1e-3]", "--sampler=bayes"], "argument --sampler: invalid choice: 'bayes'"),
    (["--space=learning_rate=[1e-3]", "--mode=minimum"], "argument --mode: invalid choice: 'minimum'"),
    (["--space=learning_rate=[x]"], "Received: 'x'. Expected a number."),
    (["--space=learning_rate=[1e-3]", "--cluster_spec=/nonexistent.json"],
     "Cannot read cluster spec /nonexistent.json"),
])
def test_bad_input_exits_2_and_starts_nothing(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", SWEEP, f"--sweep_dir={tmp_path}/sweep", *args],
                            capture_output=True, text=True, env=ENV, timeout=30, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.multiworker
@pytest.mark.slow  # 23 s: make soak, beside the grid test.
def test_tpe_sampler_runs_trials(tmp_path):
    pytest.importorskip("optuna")
    result = _sweep("--space=learning_rate=loguniform(1e-4,1e-2)", "--sampler=tpe", "--trials=2",
                    f"--sweep_dir={tmp_path}", "--", "--epochs=1", "--steps_per_epoch=5")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 2 and all(r["status"] == "finished" for r in rows)
    assert all(1e-4 <= r["learning_rate"] <= 1e-2 for r in rows)


@pytest.mark.multiworker
def test_trials_run_side_by_side_when_there_is_room(tmp_path):
    # One-worker trials on 2 CPUs: two at a time, each launcher on its own free port.
    result = subprocess.run(
        [sys.executable, "-m", SWEEP, f"--cluster_spec={ROOT}/cluster_specs/local_1worker.json",
         "--space=seed=[1,2]", f"--sweep_dir={tmp_path}", "--", "--epochs=1", "--steps_per_epoch=5"],
        capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 at a time" in result.stdout
    events = [line.split(": ")[-1].split(" ")[0] for line in result.stdout.splitlines() if line.startswith("trial ")]
    assert events[:2] == ["started", "started"], result.stdout


@pytest.mark.multiworker
def test_ctrl_c_stops_every_trial(tmp_path):
    import signal  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    proc = subprocess.Popen(
        [sys.executable, "-m", SWEEP, f"--cluster_spec={SPEC}", "--space=seed=[1]",
         f"--sweep_dir={tmp_path}", "--", "--epochs=50"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("trial-*/trial.log")) or "started worker:1" not in \
            next(tmp_path.glob("trial-*/trial.log")).read_text():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "every trial stopped" in stderr
    leftovers = subprocess.run(["pgrep", "-f", "--", f"model_dir={tmp_path}"], capture_output=True, text=True).stdout
    assert leftovers == "", leftovers
