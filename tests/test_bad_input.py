"""The corpus of malformed input (tests/bad_inputs.json) through every CLI.

Each case must give exit code 2, exactly one error line that says what is wrong, no
traceback, no hang, and leave an existing `model_dir` exactly as it was.
"""

import json
import os
import re
import sys

import pytest

import cluster_runner
from cluster_runner import QUIET_TF

ROOT = os.path.dirname(os.path.dirname(__file__))
SPECS = os.path.join(ROOT, "cluster_specs")
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
with open(os.path.join(os.path.dirname(__file__), "bad_inputs.json"), encoding="utf-8") as f:
    CORPUS = json.load(f)


def _run(args, env=None, timeout=120):
    return cluster_runner.run([sys.executable, "-m", *args], env={**ENV, **(env or {})}, timeout=timeout, cwd=ROOT)


def _one_error_line(result, prog):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def existing_model_dir(tmp_path):
    """A model_dir with a run in it; returns a function that checks it is untouched."""
    model_dir = tmp_path / "run"
    (model_dir / "backup" / "chief-0").mkdir(parents=True)
    (model_dir / "backup" / "chief-0" / "step-000000040.json").write_text('{"step": 40}')
    (model_dir / "summary.json").write_text("{}")

    def snapshot():
        return sorted((str(p.relative_to(model_dir)), p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
                      for p in model_dir.rglob("*"))

    before = snapshot()
    yield model_dir
    assert snapshot() == before


@pytest.mark.parametrize("case", CORPUS["specs"], ids=lambda c: c["text"][:40])
def test_bad_spec_through_the_launcher_and_export(tmp_path, case):
    spec = tmp_path / "spec.json"
    spec.write_text(case["text"])
    for args, prog in (
        (["distrib_tf.launch", f"--cluster_spec={spec}", "--", "true"], "distrib-tf-launch"),
        (["distrib_tf.deploy", "slurm", f"--cluster_spec={spec}", "--", "true"], "distrib-tf-export"),
    ):
        result = _run(args, timeout=30)
        assert re.search(case["error"], _one_error_line(result, prog))
        assert result.stdout == ""  # Nothing started, nothing written.


@pytest.mark.parametrize("case", CORPUS["tf_configs"], ids=lambda c: c["text"][:40])
def test_bad_tf_config_through_the_main_job(existing_model_dir, case):
    result = _run(["distrib_tf.train", "--epochs=1", f"--model_dir={existing_model_dir}"],
                  env={"TF_CONFIG": case["text"]})
    assert re.search(case["error"], _one_error_line(result, "distrib-tf-train"))


@pytest.mark.parametrize("case", CORPUS["train_flags"], ids=lambda c: " ".join(c["flags"]))
def test_bad_train_flags(existing_model_dir, case):
    result = _run(["distrib_tf.train", *case["flags"], f"--model_dir={existing_model_dir}"])
    assert case["error"] in _one_error_line(result, "distrib-tf-train")


@pytest.mark.parametrize("case", CORPUS["launch_args"], ids=lambda c: " ".join(c["args"])[-50:])
def test_bad_launch_arguments(case):
    args = [a.replace("{SPECS}", SPECS) for a in case["args"]]
    result = _run(["distrib_tf.launch", *args], env=case.get("env"), timeout=30)
    assert case["error"].replace("{SPECS}", SPECS) in _one_error_line(result, "distrib-tf-launch")
    assert result.stdout == ""


def test_corpus_is_large_enough():
    assert sum(len(v) for v in CORPUS.values() if isinstance(v, list)) >= 30


@pytest.mark.parametrize("case", CORPUS["layouts"], ids=lambda c: " ".join(c["flags"]))
def test_local_strategy_under_a_cluster_is_refused(existing_model_dir, case):
    result = _run(["distrib_tf.train", *case["flags"], f"--model_dir={existing_model_dir}"],
                  env={"TF_CONFIG": json.dumps(case["tf_config"])})
    assert case["error"] in _one_error_line(result, "distrib-tf-train")


def _backup(model_dir, task, run, step=40):
    folder = model_dir / "backup" / task
    folder.mkdir(parents=True)
    (folder / f"step-{step:09d}.weights.h5").write_bytes(b"weights")
    (folder / f"step-{step:09d}.json").write_text(json.dumps({"run": run, "step": step}))


@pytest.mark.multiworker
def test_another_runs_backup_on_one_worker_stops_every_worker(tmp_path):
    """(Backups of this run at different steps are no error: the newest wins, test_backup.py.)"""
    from cluster_runner import local_spec  # pylint: disable=import-outside-toplevel
    from cluster_runner import run_cluster  # pylint: disable=import-outside-toplevel
    from distrib_tf.train import TrainConfig  # pylint: disable=import-outside-toplevel

    model_dir = tmp_path / "run"
    flags = ["--epochs=2", "--steps_per_epoch=40"]
    run = TrainConfig(epochs=2, steps_per_epoch=40).run_id()
    _backup(model_dir, "worker-0", run)
    _backup(model_dir, "worker-1", "another-run")
    before = sorted((str(p), p.read_bytes()) for p in model_dir.rglob("*") if p.is_file())
    results = run_cluster(["-m", "distrib_tf.train", *flags, f"--model_dir={model_dir}"],
                          spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=180)
    for result in results:
        assert result.returncode == 2, (result.task, result.output[-2000:])
        lines = [line for line in result.output.splitlines() if line.startswith("distrib-tf-train: error: ")]
        assert len(lines) == 1 and "Cannot resume: worker:1 holds a backup of a different run" in lines[0], (
            result.output[-2000:])
        assert "Traceback" not in result.output
    assert sorted((str(p), p.read_bytes()) for p in model_dir.rglob("*") if p.is_file()) == before
