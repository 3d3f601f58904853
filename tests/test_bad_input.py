"""The corpus of malformed input (tests/bad_inputs.json) through every CLI.

Each case must give exit code 2, exactly one error line that says what is wrong, no
traceback, no hang, and leave an existing `model_dir` exactly as it was.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from cluster_runner import QUIET_TF

ROOT = os.path.dirname(os.path.dirname(__file__))
SPECS = os.path.join(ROOT, "cluster_specs")
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
with open(os.path.join(os.path.dirname(__file__), "bad_inputs.json"), encoding="utf-8") as f:
    CORPUS = json.load(f)


def _run(args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout, cwd=ROOT)


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
    (model_dir / "backup").mkdir(parents=True)
    (model_dir / "backup" / "training_metadata.json").write_text('{"epoch": 2, "batch": 0}')
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
        (["distrib_tf.export", "slurm", f"--cluster_spec={spec}", "--", "true"], "distrib-tf-export"),
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
    result = _run(["distrib_tf.launch", *args], timeout=30)
    assert case["error"] in _one_error_line(result, "distrib-tf-launch")
    assert result.stdout == ""


def test_corpus_is_large_enough():
    assert sum(len(v) for v in CORPUS.values() if isinstance(v, list)) >= 30
