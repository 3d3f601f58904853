"""The main job end to end: real runs of both models, 2 workers, resume, bad flags."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster_runner import QUIET_TF
from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_single

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {"PYTHONPATH": ROOT}
TRAIN = ["-m", "distrib_tf.train"]


def _summary(model_dir):
    with open(os.path.join(model_dir, "summary.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("model, dataset, chance", [("cnn", "shapes", 0.1), ("transformer", "tokens", 0.25)])
def test_offline_default_trains_and_beats_chance(tmp_path, model, dataset, chance):
    model_dir = tmp_path / "run"
    result = run_single([*TRAIN, f"--model={model}", "--epochs=2", "--steps_per_epoch=60",
                         f"--model_dir={model_dir}"], env=ENV, timeout=300)
    check_ok([result])
    summary = _summary(model_dir)
    assert summary["config"]["dataset"] == dataset
    assert summary["strategy"] == "OneDeviceStrategy" and summary["replicas"] == 1
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(summary["epochs"][0])
    assert summary["final"]["accuracy"] > 2.5 * chance, summary["final"]
    assert summary["examples_per_second"] > 0 and summary["wall_seconds"] > 0
    assert f"final accuracy {summary['final']['accuracy']:.4f}" in result.output
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "logs", "summary.json"]  # backup/ removed on success
    assert os.stat(model_dir).st_mode & 0o777 == 0o700


@pytest.mark.multiworker
@pytest.mark.parametrize("model, precision", [("cnn", "off"), ("transformer", "bfloat16")])
def test_two_workers_write_one_summary(tmp_path, model, precision):
    model_dir = tmp_path / "run"
    results = check_ok(run_cluster([*TRAIN, f"--model={model}", f"--mixed_precision={precision}", "--epochs=2",
                                    "--steps_per_epoch=20", f"--model_dir={model_dir}"],
                                   spec=local_spec(2), env=ENV, timeout=300))
    summary = _summary(model_dir)
    assert summary["config"]["mixed_precision"] == precision
    assert all(v == v for v in summary["final"].values())  # No NaN.
    assert summary["workers"] == 2 and summary["replicas"] == 2
    assert summary["strategy"] == "MultiWorkerMirroredStrategy"
    assert "final accuracy" in results[0].output and "final accuracy" not in results[1].output
    assert "worker:1 epoch 2/2 accuracy=" in results[1].output
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["epoch001.weights.h5", "epoch002.weights.h5"]


def test_killed_run_resumes_from_backup(tmp_path):
    args = [sys.executable, *TRAIN, "--epochs=3", "--steps_per_epoch=40", f"--model_dir={tmp_path}"]
    env = {**os.environ, **QUIET_TF, **ENV}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metadata = tmp_path / "backup" / "training_metadata.json"
    deadline = time.monotonic() + 180
    while not metadata.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert metadata.exists(), "no backup written before the deadline"
    done = json.loads(metadata.read_text())["epoch"]
    assert done in (1, 2)
    check_ok([run_single(args[1:], env=ENV, timeout=300)])
    summary = _summary(tmp_path)
    assert [e["epoch"] for e in summary["epochs"]] == list(range(done + 1, 4))
