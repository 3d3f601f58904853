"""The notebook helpers: a job handle whose stop() leaves nothing behind; plots from a run."""

import json
import os
import sys
import time

import pytest

from distrib_tf.experiments import notebook

ROOT = os.path.dirname(os.path.dirname(__file__))
SPEC = os.path.join(ROOT, "cluster_specs", "local_2workers.json")
SLEEPER = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "from distrib_tf import events; events.emit('train_begin', epochs=2, steps=1, workers=2); "
           "time.sleep(120)"]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_stop_leaves_no_process_behind(tmp_path):
    job = notebook.start_job(SPEC, model_dir=str(tmp_path), command=SLEEPER)
    deadline = time.monotonic() + 30
    while len(job.pids) < 2 or [row["epochs"] for row in job.progress()] != ["0/2", "0/2"]:
        assert time.monotonic() < deadline, (job.tail("launcher"), job.progress())
        time.sleep(0.1)
    assert job.status == "running"
    pids = list(job.pids.values())
    job.stop(grace=20)
    assert job.status == "stopped"
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(ProcessLookupError):  # Not a signal to whatever process has that id now.
        job.kill_task("worker:0")


def test_wait_raises_the_launchers_root_cause(tmp_path):
    job = notebook.start_job(SPEC, model_dir=str(tmp_path), max_restarts=0,
                             command=[sys.executable, "-c", "import os; os._exit(3)"])
    with pytest.raises(notebook.JobFailed, match=r"^worker:\d exited with code 3"):
        job.wait(timeout=60, progress=False)
    missing = notebook.start_job(str(tmp_path / "nope.json"), model_dir=str(tmp_path), command=["true"])
    with pytest.raises(notebook.JobFailed, match=r"distrib-tf-launch: error: .*nope\.json"):
        missing.wait(timeout=60, progress=False)


def test_plots_read_a_model_dir(tmp_path):
    summary = {"epochs": [{"epoch": e, "loss": 1.0 / e, "accuracy": 0.5 + e / 10, "val_loss": 1.2 / e,
                           "val_accuracy": 0.4 + e / 10, "examples_per_second": 1000.0 + e} for e in (1, 2, 3)]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    notebook.plot_history(str(tmp_path), save=str(tmp_path / "history.png"))
    notebook.plot_throughput(str(tmp_path), save=str(tmp_path / "throughput.png"))
    notebook.compare_runs({"a": str(tmp_path), "b": summary}, save=str(tmp_path / "compare.png"))
    notebook.plot_scaling([("1", 1, 1000.0), ("2", 2, 1500.0)], save=str(tmp_path / "scaling.png"))
    for name in ("history", "throughput", "compare", "scaling"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
