"""The benchmark scripts run end to end at a toy size (figures are not checked: not timed tests)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
RATIOS = ["p1_step_time_ratio", "p1_wall_per_epoch_ratio", "p2_pipeline_ratio_cnn",
          "p2_pipeline_ratio_transformer", "p4_first_step_ratio", "p4_total_ratio"]


@pytest.mark.multiworker
@pytest.mark.slow
def test_benchmarks_run_at_a_tiny_size(tmp_path):
    if shutil.which("iperf3") is None:
        pytest.skip("P3 needs iperf3 (apt-get install iperf3; .ci/run installs it)")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--tiny", f"--out={tmp_path}"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert set(results["environment"]) >= {"tensorflow", "keras", "python", "machine"}
    for key in RATIOS:
        assert results[key]["min"] <= results[key]["median"] <= results[key]["max"] and results[key]["min"] > 0
    assert results["p3_ceiling_bytes_per_second"]["median"] > 0
    assert set(results["p3_allreduce"]) == {"0.1", "1"}
    assert (tmp_path / "allreduce.png").stat().st_size > 1000


def _scaling(results):
    link = results["links"]["1 Gbit/s"]
    cnn = link["cnn"]
    split = [cnn[f"two_workers_{part}_seconds"]["median"] for part in ("collective", "wait", "own", "wall")]
    return (cnn["efficiency"]["median"] > 0 and link["allreduce"]["1"]["fraction_of_link"]["median"] > 0
            and 0 < cnn["bound"]["median"] < 1 and link["transformer"]["fraction_of_bound"]["median"] > 0
            and cnn["side_by_side_examples_per_second"]["median"] > 0 and cnn["machine_bound"]["median"] > 0
            # Per step the last to arrive waits least, and a step is its own part and its wait.
            and 0 < split[0] <= split[1] < split[3] and 0 < split[2] < split[3]
            # Waiting for the slower of two can only lower the bound.
            and 0 < cnn["synchronous_bound"]["median"] <= cnn["machine_bound"]["median"]
            and cnn["paced_collectives_step_seconds"]["median"] > 0 and cnn["paced_bound"]["median"] > 0)


def _sync(results):
    rows = results["models"]["cnn"]["100 Mbit/s"]
    return rows["step"]["bytes_sent_per_worker"] > rows["every:8"]["bytes_sent_per_worker"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name, check", [("scaling", _scaling), ("sync", _sync)])
def test_shaped_link_benchmarks_run_at_a_tiny_size(tmp_path, name, check):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), "--tiny",
                             f"--out={tmp_path}"], capture_output=True, text=True, timeout=900)
    if "cannot run here" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / f"{name}.json") as f:
        assert check(json.load(f))
    assert (tmp_path / f"{name}.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_data_benchmark_runs_at_a_tiny_size(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "data.py"), "--sizes_gb=0.02,0.2",
                             "--reps=1", "--steps=5", f"--dir={tmp_path / 'data'}", f"--out={tmp_path / 'data.json'}"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "data.json") as f:
        results = json.load(f)
    assert set(results["sizes"]) == {"0.02", "0.2"}
    for row in results["sizes"].values():
        assert row["examples_per_second"]["median"] > 0 and row["tfrecord_examples_per_second"]["median"] > 0
    # 15 batches of 128 served from 17,000 examples: a worker that read the split would be at 1 or more.
    assert results["sizes"]["0.2"]["bytes_read_fraction_of_split"]["max"] < 0.5
    report = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert "## make bench-data" in report.stdout and "| 0.2 GiB" in report.stdout, report.stderr


@pytest.mark.slow
def test_the_overhead_ablation_runs_at_a_tiny_size(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "overhead.py"), "--tiny",
                             "--models=cnn", f"--out={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "overhead.json") as f:
        rows = json.load(f)["models"]["cnn"]
    assert set(rows) == {"full", "none_of_ours"} and rows["none_of_ours"]["ratio_to_none_of_ours"]["median"] == 1
    report = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert "## make bench-overhead" in report.stdout and "| cnn | full |" in report.stdout, report.stderr


@pytest.mark.multiworker
@pytest.mark.slow
def test_the_backup_benchmark_measures_the_blocked_time_at_a_tiny_size(tmp_path):
    out = tmp_path / "backups.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "backups.py"), "--tiny",
                             "--repeats=1", f"--out={out}"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = {(r["workers"], r["case"]): r for r in json.loads(out.read_text())["cases"]}
    assert set(rows) == {(n, case) for n in (1, 2) for case in ("epoch ends", "every 5, background",
                                                                 "every 5, synchronous")}
    for (_, case), row in rows.items():
        # The start, (every 5 of 10,) the epoch's end, and the state `fit` returned (after its
        # callbacks' on_train_end: restore_best_weights, EMA's swap).
        assert row["backups"] == (3 if case == "epoch ends" else 4), row
        assert row["blocked_seconds_per_backup"]["median"] > 0 and row["write_seconds"]["median"] > 0, row
        assert row["fit_seconds"]["median"] > 0 and row["ratio_to_epoch_ends"] > 0, row
