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
from cluster_runner import checkpoint_arrays
from cluster_runner import finished_backups
from cluster_runner import latest_backup
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_single
from cluster_runner import weights_difference

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
    # The chief's outputs, and the last backup.
    assert sorted(os.listdir(model_dir)) == ["backup", "checkpoints", "logs", "model.keras", "serving", "summary.json"]
    assert finished_backups(model_dir) == {"chief-0": [(120, True)]}  # Its last, for a rerun to return at once.
    assert os.stat(model_dir).st_mode & 0o777 == 0o700


@pytest.mark.multiworker
@pytest.mark.parametrize("model, precision", [  # make soak (make test's launcher test checks the rest).
    pytest.param("cnn", "off", marks=pytest.mark.slow),
    pytest.param("transformer", "bfloat16", marks=pytest.mark.slow)])
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
    assert sorted(os.listdir(model_dir / "checkpoints")) == [
        "epoch001.json", "epoch001.weights.h5", "epoch002.json", "epoch002.weights.h5"]


@pytest.mark.slow  # One process; the launcher's kill-and-resume tests run in make test.
def test_killed_run_resumes_from_backup(tmp_path):
    args = [sys.executable, *TRAIN, "--epochs=3", "--steps_per_epoch=40", f"--model_dir={tmp_path}"]
    env = {**os.environ, **QUIET_TF, **ENV}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 180  # Killed once an epoch's end is backed up (not the start's, epoch 0).
    while (latest_backup(tmp_path) or {}).get("epoch", 0) < 1 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest_backup(tmp_path), "no backup written before the deadline"
    done = latest_backup(tmp_path)["epoch"]
    assert done in (1, 2)
    resumed = run_single(args[1:], env=ENV, timeout=300)
    check_ok([resumed])
    assert f"resumes at step {done * 40} (epoch {done + 1}, step 0 of it)" in resumed.output, resumed.output[-3000:]
    summary = _summary(tmp_path)
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3]  # Every epoch once, those before from the backup.


# The layouts compute the same sums in different orders, so they agree to the rounding of
# the arithmetic, no better. The transformer in float32: losses 1e-4, weights 4e-7. The
# CNN's float32 weights end 1e-4 to 5e-4 apart after these 12 steps, the same size as the
# one-process run against itself with oneDNN off (1e-4): its training magnifies rounding
# (`make bench-layout`). In float64 its layouts agree to 5e-15, so
# the CNN is tested in float64: a real difference (a batch out of order, statistics over one
# replica's batch, a gradient summed twice) shows at 1e-4 or more.
LAYOUT_CASES = {  # model: (extra flags, tolerance of losses, of final weights)
    "cnn": (["--float64"], 1e-6, 1e-10),  # Losses: Keras keeps its metrics in float32. Data read from disk.
    "transformer": ([], 1e-4, 1e-5),
}
LAYOUTS = {"2 replicas": ("single", ["--cpu_replicas=2"]), "2 workers": (2, []), "4 workers": (4, [])}


@pytest.mark.multiworker
@pytest.mark.parametrize("model, layouts", [  # make soak: 4 workers (2 cores: 80 s), the transformer.
    ("cnn", ["2 replicas", "2 workers"]), pytest.param("cnn", ["4 workers"], marks=pytest.mark.slow),
    pytest.param("transformer", list(LAYOUTS), marks=pytest.mark.slow)])
def test_results_do_not_depend_on_the_layout(tmp_path, model, layouts, shapes_on_disk):
    """One process, 2 logical replicas, 2 and 4 workers: the same losses and weights. The CNN
    streams its data from ArrayRecord shards, each worker reading only its own examples."""
    precision, losses_rtol, weights_rtol = LAYOUT_CASES[model]
    dataset = [f"--dataset={shapes_on_disk}"] if model == "cnn" else []
    args = [*TRAIN, f"--model={model}", *precision, *dataset, "--epochs=2", "--steps_per_epoch=6",
            "--global_batch_size=64"]
    reference_dir = tmp_path / "one"
    check_ok([run_single([*args, "--strategy=one_device", f"--model_dir={reference_dir}"], env=ENV, timeout=300)])
    reference = _summary(reference_dir)
    for name in layouts:
        workers, extra = LAYOUTS[name]
        model_dir = tmp_path / name.replace(" ", "_")
        argv = [*args, *extra, f"--model_dir={model_dir}"]
        if workers == "single":
            check_ok([run_single(argv, env=ENV, timeout=300)])
        else:
            check_ok(run_cluster(argv, spec=local_spec(workers), env=ENV, timeout=400))
        summary = _summary(model_dir)
        assert summary["replicas"] == (2 if workers == "single" else workers), name
        for got, expected in zip(summary["epochs"], reference["epochs"], strict=True):
            for metric in ("loss", "val_loss"):
                assert got[metric] == pytest.approx(expected[metric], rel=losses_rtol), (name, got, expected)
        arrays = checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5")
        model_dtypes = {a.dtype.name for path, a in arrays.items() if not path.startswith("optimizer")}
        assert model_dtypes == {"float64" if precision else "float32"}, model_dtypes
        difference = weights_difference(
            arrays, checkpoint_arrays(reference_dir / "checkpoints" / "epoch002.weights.h5"))
        losses = max(abs(g["loss"] / e["loss"] - 1) for g, e in zip(summary["epochs"], reference["epochs"]))
        print(f"{model} {name}: losses within {losses:.2g}, weights within {difference:.2g} (relative)")
        assert difference <= weights_rtol, (name, difference)
