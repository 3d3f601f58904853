"""Start the tasks of a cluster spec as local processes, each with its own TF_CONFIG."""

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

from distrib_tf.cluster import ClusterSpec
from distrib_tf.launch import forkserver

QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_RUNNER = os.path.join(ROOT, "tests", "workers", "run_example.py")


@dataclasses.dataclass
class TaskResult:
    task: str
    returncode: int
    output: str


def local_spec(num_workers: int) -> ClusterSpec:
    return ClusterSpec.from_dict({"cluster": {"worker": ["127.0.0.1:0"] * num_workers}})


def run_cluster(argv, *, spec, env=None, timeout=180) -> list[TaskResult]:
    """Runs `python argv...` once per task of `spec`; SIGKILLs all at `timeout` seconds."""
    spec = spec.with_free_ports()
    procs = []
    for task in spec.tasks:
        task_env = {**os.environ, **QUIET_TF, **(env or {}), "TF_CONFIG": spec.tf_config(task)}
        procs.append((str(task), popen([sys.executable, *map(str, argv)], env=task_env)))
    return _collect(procs, timeout)


def popen(command, *, env):
    """`command` started with its output in a text pipe, in a session of its own: forked from
    the suite's pre-imported interpreter where it serves `command` (`conftest._forkserver`)."""
    if forkserver.serves(command, env):
        return forkserver.spawn(command, env=env, stdout=-1, stderr=-2, text=True)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def run(command, *, env, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)`, forked where a server serves
    `command` (a main job refusing its flags may import TensorFlow first)."""
    if not forkserver.serves(command, env):
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryFile("w+") as stderr:
        task = forkserver.spawn(command, env=env, cwd=cwd, stdout=-1, stderr=stderr.fileno(), text=True)
        try:
            output, _ = task.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # Its group, unless it ended meanwhile.
                os.killpg(task.pid, signal.SIGKILL)
            raise
        stderr.seek(0)
        return subprocess.CompletedProcess(command, task.returncode, output, stderr.read())


def run_single(argv, *, env=None, timeout=180) -> TaskResult:
    """Runs `python argv...` as one process with no TF_CONFIG."""
    base = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    proc = popen([sys.executable, *map(str, argv)], env={**base, **QUIET_TF, **(env or {})})
    return _collect([("single", proc)], timeout)[0]


def _collect(procs, timeout):
    deadline = time.monotonic() + timeout
    results = []
    for name, proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for _, other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += f"\n[killed after {timeout}s]"
        results.append(TaskResult(name, proc.returncode, output))
    return results


def check_ok(results):
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(
        f"--- {r.task} exited {r.returncode}:\n{r.output[-3000:]}" for r in failed
    )
    return results


def start_and_wait_for(cmd, out, *, marker: str, count: int, env=None, timeout: float = 60):
    """Starts `cmd` writing into the open file `out`; waits until `marker` appears `count` times.

    Returns `(process, text so far)`; kills the process and fails if that takes too long.
    """
    # The child writes through a descriptor of its own, in append mode: on `out`'s own, the
    # seek(0) below would move the offset it writes at, and its lines would overwrite others.
    with open(out.name, "a", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        out.seek(0)
        text = out.read()
        if text.count(marker) >= count:
            return proc, text
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{marker!r} did not appear {count} times in {timeout} s:\n{text[-3000:]}")


def latest_backup(model_dir, task: str = "*") -> dict | None:
    """The metadata of the newest backup past the start that `task` (`worker-1`; any) holds."""
    found = [json.loads(p.read_text()) for p in pathlib.Path(model_dir).glob(f"backup/{task}/step-*.json")]
    found = [meta for meta in found if meta["step"] > 0]
    return max(found, key=lambda m: m["step"]) if found else None


def checkpoint_arrays(path) -> dict:
    """Every array of a Keras `.weights.h5` file, by its path inside the file."""
    import h5py  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, np.array(item))
                     if isinstance(item, h5py.Dataset) else None)
    return arrays


def weights_difference(got: dict, expected: dict) -> float:
    """`|got - expected| / |expected|` over all model arrays (L2; optimizer slots left out)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    assert got.keys() == expected.keys()
    names = [name for name in expected if not name.startswith("optimizer")]
    difference = sum(float(np.sum((got[n].astype(np.float64) - expected[n]) ** 2)) for n in names)
    size = sum(float(np.sum(expected[n].astype(np.float64) ** 2)) for n in names)
    return (difference / size) ** 0.5


def kill_left(procs) -> None:
    """SIGKILLs and reaps whichever of `procs` still run (a test's `finally`)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finished_backups(model_dir) -> dict:
    """What a clean end leaves in `model_dir/backup/`: each task directory's backups as
    `{dir: [(step, finished)]}` (one, marked finished, per task and `fit`)."""
    found = {}
    for meta in sorted(pathlib.Path(model_dir, "backup").glob("**/step-*.json")):
        record = json.loads(meta.read_text())
        found.setdefault(str(meta.parent.relative_to(pathlib.Path(model_dir, "backup"))), []).append(
            (record["step"], bool(record.get("finished"))))
    return found


def run_script(script: str, model_dir, *args, env: dict, timeout: float = 240):
    """One process of a worker script that prints `RESULT {...}`: `(exit code, its output, the result)`."""
    result = subprocess.run([sys.executable, script, str(model_dir), *map(str, args)], capture_output=True,
                            text=True, timeout=timeout, env=env)
    found = re.search(r"^RESULT (\{.*\})$", result.stdout, re.M)
    return result.returncode, result.stdout + result.stderr, json.loads(found.group(1)) if found else None


def run_example(cwd, script, *args, workers: int = 2, timeout: float = 300):
    """A user's script run by `tests/workers/run_example.py` in `cwd`, through the launcher on
    `workers` workers (0: one process, no launcher): `(exit code, output, {task: what it printed})`,
    the task `single` for one process."""
    command = [sys.executable, EXAMPLE_RUNNER, script, *map(str, args)]
    if workers:
        command = [sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}", "--", *command]
    env = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    text = result.stdout + result.stderr
    results = dict(re.findall(r"(?:\[(worker:\d)\] )?EXAMPLE (\{.*\})", text))
    return result.returncode, text, {task or "single": json.loads(found) for task, found in results.items()}


def preempt_and_resume(cwd, script, *args, step: int, timeout: float = 300):
    """`script` on 2 workers, SIGTERMed on worker:1 once it has taken `step` steps (exit 75),
    then started again in `cwd` to its end: `(the step every worker backed up, the restarted
    run's `run_example` results)`. Fails unless both workers agreed on one step and resumed there."""
    code, text, _ = run_example(cwd, script, *args, f"--sigterm_at_step={step}", timeout=timeout)
    assert code == 75, (step, text[-3000:])
    saved = {int(s) for s in re.findall(r"preempted: backed up step (\d+) like every worker", text)}
    assert len(saved) == 1, (step, text[-3000:])
    saved_step = saved.pop()
    code, text, resumed = run_example(cwd, script, *args, timeout=timeout)
    assert code == 0, text[-3000:]
    assert len(re.findall(rf"worker:\d resumes at step {saved_step} ", text)) == 2, text[-3000:]
    return saved_step, resumed
