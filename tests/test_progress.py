"""The event stream, the status line, per-worker step times, stragglers and quiet output."""

import io
import json
import os
import re
import subprocess
import sys

import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from distrib_tf import events
from distrib_tf.keras.progress import stragglers
from distrib_tf.launch import console
from distrib_tf.launch.supervise import TaskExit
from distrib_tf.launch.supervise import is_quieted

ROOT = os.path.dirname(os.path.dirname(__file__))
LAUNCH = [sys.executable, "-m", "distrib_tf.launch"]


def test_status_line_names_the_slowest_worker():
    line = console.status_line({"epoch": 1, "epochs": 3, "step": 5, "steps": 10, "examples_per_second": 100.4,
                               "eta_seconds": 3725, "worker_step_seconds": {"worker:0": 0.2, "worker:1": 0.05}})
    assert line == "epoch 1/3  step 5/10  100 examples/s  ETA 1:02:05  slowest worker:0 200 ms/step"


def test_a_straggler_is_slower_than_the_median_of_the_others():
    assert stragglers({"worker:0": 0.1, "worker:1": 0.149}, 1.5) == {}
    assert stragglers({"worker:0": 0.1, "worker:1": 0.16}, 1.5) == {"worker:1": pytest.approx(1.6)}
    assert set(stragglers({"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.5}, 1.5)) == {"d"}
    assert stragglers({"worker:0": 0.1}, 1.5) == {}


def test_an_epoch_resumed_after_its_start_counts_the_examples_of_its_own_steps(monkeypatch):
    """Issue 42 item 9: the resumed epoch's rate divided a whole epoch's examples by the time of
    its remaining steps (3 of 10 steps: 3.3 times too fast)."""
    from distrib_tf.keras import callbacks  # pylint: disable=import-outside-toplevel

    clock = iter([0.0, 1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 110.0])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    timer, logs = callbacks.EpochTimer(32), [{}, {}]
    for epoch, steps in enumerate((3, 10)):  # The resumed epoch's last 3 steps, then a whole one.
        timer.on_epoch_begin(epoch)
        for batch in range(steps):
            timer.on_train_batch_end(batch)
        timer.on_epoch_end(epoch, logs[epoch])
    assert [log["examples_per_second"] for log in logs] == [3 * 32 / 3.0, 10 * 32 / 100.0]
    assert timer.examples == [96, 320] and timer.steady_rate() == 320 / 100.0


def test_quiet_drops_only_tensorflows_info_warning_and_cuinit_lines():
    assert is_quieted("I0000 00:00:1796081295.668845       2 port.cc:153] oneDNN custom operations are on.")
    assert is_quieted("W0000 00:00:1796081021.146351       2 dataset.cc:997] Input of GeneratorDatasetOp")
    assert is_quieted("E0000 00:00:1796080986.437372       2 cuda_platform.cc:52] failed call to cuInit: INTERNAL")
    assert not is_quieted("E0000 00:00:1796080986.437372       2 coordination_service.cc:1] The following tasks "
                          "are unhealthy (stopped sending heartbeats)")
    assert not is_quieted("Epoch 1/3")


# Issue 54: TensorFlow 2.18.1's and 2.19.1's lines at import, as they wrote them here (2.20 and 2.21 write none).
CUDA_FACTORY_LINES = [
    "2026-12-04 19:18:02.133242: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:477] Unable to register "
    "cuFFT factory: Attempting to register factory for plugin cuFFT when one has already been registered",
    "E0000 00:00:1796411882.154882   20392 cuda_dnn.cc:8310] Unable to register cuDNN factory: Attempting to "
    "register factory for plugin cuDNN when one has already been registered",
    "E0000 00:00:1796411882.158717   20392 cuda_blas.cc:1418] Unable to register cuBLAS factory: Attempting to "
    "register factory for plugin cuBLAS when one has already been registered",
]


@pytest.mark.parametrize("line", CUDA_FACTORY_LINES)
def test_quiet_drops_tensorflows_cuda_factory_lines_at_import(line):
    assert is_quieted(line)
    assert not is_quieted(line.replace("Unable to register", "Unable to load"))  # Only that error.
    assert not is_quieted(line.replace("when one has already been registered", "that failed"))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_status_line_stays_under_the_output_on_a_terminal(tmp_path):
    out = _Terminal()
    sink = console.Sink(out, path=str(tmp_path / "events.jsonl"))
    sink.event("worker:0", {"event": "progress", "epoch": 1, "epochs": 2, "step": 3, "steps": 9})
    sink.line("[worker:0] hello")
    sink.event("worker:1", {"event": "progress", "epoch": 1, "epochs": 2, "step": 2, "steps": 9})  # Not shown.
    sink.close()
    assert out.getvalue() == ("\r\x1b[Kepoch 1/2  step 3/9" "\r\x1b[K[worker:0] hello\nepoch 1/2  step 3/9" "\n")
    assert [(e["task"], e["step"]) for e in events.read(str(tmp_path / "events.jsonl"))] == [
        ("worker:0", 3), ("worker:1", 2)]


def test_a_follower_reads_whole_lines_only(tmp_path):
    path = tmp_path / "events.jsonl"
    follow = events.Follower(str(path))
    assert follow() == []
    path.write_text('{"event": "a"}\n{"event": "b"')
    assert [e["event"] for e in follow()] == ["a"]
    with open(path, "a") as f:
        f.write('}\nnot json\n')
    assert [e["event"] for e in follow()] == ["b"]


def test_the_root_cause_is_the_tasks_own_error_else_its_last_line():
    assert TaskExit("worker:1", 1, ["x", "Traceback", "ValueError: bad", ""]).root_cause() == \
        "worker:1 exited with code 1: ValueError: bad"
    assert TaskExit("worker:1", -9, [], error="boom").root_cause() == "worker:1 was killed by SIGKILL: boom"


def test_one_process_writes_the_profile_of_the_steps_asked_for(tmp_path):
    """--profile_steps=5,8 across no epoch end; one process, where the profiler has not
    crashed (ProfileSteps: with several workers it can, and warns)."""
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.train", "--epochs=1", "--steps_per_epoch=10",
         "--profile_steps=5,8", f"--model_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "host tracer" not in result.stdout + result.stderr
    profiles = list((tmp_path / "logs" / "chief_0").rglob("*.xplane.pb"))
    assert len(profiles) == 1 and profiles[0].stat().st_size > 10_000, profiles


@pytest.mark.multiworker
@pytest.mark.slow  # 15 s: make soak (make test's time); the straggler rule itself: test_a_straggler_is_slower...
def test_a_slowed_worker_is_named_a_straggler_once(tmp_path):
    """worker:1 sleeps 80 ms before every step: its own step time shows it, worker:0's
    (which waits for it in the all-reduce) does not, and the chief names it once."""
    stream = tmp_path / "events.jsonl"
    result = subprocess.run(
        [*LAUNCH, "--workers=2", f"--events={stream}", "--", sys.executable,
         os.path.join(ROOT, "tests", "workers", "straggler.py"), f"--out={tmp_path}"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    named = [line for line in result.stdout.splitlines() if "straggler:" in line]
    assert len(named) == 1 and named[0].startswith("[worker:0] distrib_tf: straggler: worker:1's steps take"), named
    seen = [json.loads((tmp_path / f"worker_{i}.json").read_text()) for i in (0, 1)]
    assert seen[0]["latest"] == seen[1]["latest"]  # Exchanged: every worker knows every time.
    times = seen[0]["history"]
    assert min(times["step_seconds_worker_1"]) > 0.08 > 2 * max(times["step_seconds_worker_0"])
    flagged = [e for e in events.read(str(stream)) if e["event"] == "straggler"]
    assert {e["task"] for e in flagged} == {"worker:0", "worker:1"}
    assert {e["straggler"] for e in flagged} == {"worker:1"}


@pytest.mark.multiworker
def test_keras_progress_bars_of_fit_evaluate_and_predict_come_from_the_chief_alone(tmp_path):
    """A script's `fit`, `evaluate` and `predict` with `verbose=1` under a live run on 2
    workers (`tests/workers/verbose_user.py`): the chief prints Keras's progress bars; worker:1
    prints no bar (no `\\r`, ANSI or backspaces): one line an epoch of `fit` (every worker speaks
    in these tests: DISTRIB_TF_VERBOSE=1), nothing for `evaluate` and `predict` (which printed
    Keras's bars there too)."""
    results = check_ok(run_cluster([os.path.join(ROOT, "tests", "workers", "verbose_user.py"), tmp_path / "run"],
                                   spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=240))
    said = {}
    for result in results:
        parts = re.split(r"^== (fit|evaluate|predict|end)\n", result.output, flags=re.M)
        said[result.task] = dict(zip(parts[1::2], parts[2::2]))
    chief, other = said["worker:0"], said["worker:1"]
    for name in ("fit", "evaluate", "predict"):
        assert "4/4" in chief[name] and "\x1b[" in chief[name], (name, chief)  # Keras's own bars.
    assert other["evaluate"] == other["predict"] == "", other
    lines = other["fit"].splitlines()
    assert [line.split(" loss=")[0].split(" epoch_seconds")[0] for line in lines] == [
        "worker:1 epoch 1/2", "worker:1 epoch 2/2"], other
    assert not any(c in other["fit"] for c in "\r\x1b\x08"), other


def test_events_go_only_to_the_pipe_the_variable_names():
    """A process that inherited the variable but not the pipe (a wrapper's child), or holds
    another pipe at that number, writes nothing."""
    code = "from distrib_tf import events; events.emit('x', n=1); print(events.enabled())"
    fd = 123

    def run(value, keep):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              pass_fds=(fd,) if keep else (),
                              env={**os.environ, "PYTHONPATH": ROOT, events.FD_ENV: value}).stdout.split()

    def pipe_at_fd():
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        return read_end

    read_end = pipe_at_fd()
    name = events.pipe_name(fd)
    assert run(name, keep=True) == ["True"]
    os.close(fd)
    with os.fdopen(read_end) as pipe:
        assert [json.loads(line)["n"] for line in pipe] == [1]
    read_end = pipe_at_fd()  # Another pipe at that number: its inode differs.
    assert run(name, keep=True) == ["False"]
    assert run(events.pipe_name(fd), keep=False) == ["False"]
    os.close(fd)
    with os.fdopen(read_end) as pipe:
        assert pipe.read() == ""  # Nothing came through it.
