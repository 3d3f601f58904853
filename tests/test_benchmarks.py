"""The benchmark scripts run end to end at a toy size (figures are not checked: not timed tests)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
KEYS = ["p1_overhead_ratio", "p2_pipeline_headroom_cnn", "p2_pipeline_headroom_transformer",
        "p3_allreduce_fraction_of_loopback", "p4_startup_ratio", "throughput"]


@pytest.mark.multiworker
def test_benchmarks_run_at_a_tiny_size(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--tiny", f"--out={tmp_path}"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    for key in KEYS:
        assert key in results
    for key in KEYS[:-1]:
        assert results[key] > 0
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert (tmp_path / "allreduce.png").stat().st_size > 1000
    assert "| `p1_overhead_ratio` |" in (tmp_path / "results.md").read_text()
