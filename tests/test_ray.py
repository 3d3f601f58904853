"""Ray Train on a local cluster of two nodes: a head, and a worker node in a network
namespace of its own (root and iproute2), each with its own disk at the job's
`--model_dir` (a tmpfs in a mount namespace of its own). The test's driver runs beside
the head. Traffic stays inside the two namespaces the test makes.

`make test-ray` runs this file in a venv of its own with the `ray` extra
(`DISTRIB_TF_REQUIRE_RAY=1`, where a missing Ray or root fails instead of skipping);
`make test` skips it.
"""

import csv
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import netns
from cluster_runner import QUIET_TF
from distrib_tf import events
from distrib_tf import exit_codes

ROOT = os.path.dirname(os.path.dirname(__file__))
RAY_USER = os.path.join(ROOT, "tests", "workers", "ray_user.py")
SWEPT = os.path.join(ROOT, "tests", "workers", "swept_script.py")  # A user's script a sweep runs.
MY_SCRIPT = os.path.join(ROOT, "tests", "workers", "my_script.py")  # A user's script on the run API.
TAG_ENV = "DISTRIB_TF_TEST_RAY"  # Marks the processes of this test's cluster.


def _need(why: str):
    if os.environ.get("DISTRIB_TF_REQUIRE_RAY") == "1":
        pytest.fail(why)
    pytest.skip(why, allow_module_level=True)


try:
    import ray  # noqa: F401  pylint: disable=unused-import
except ImportError:
    _need("needs the ray extra (make test-ray)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`(run, base, tag)`: `run(argv)` runs a driver beside the head; `base` holds `disk`,
    the path each node mounts its own tmpfs at, and `storage`, which both nodes see; every
    process of the cluster has `tag` in its environment."""
    reason = netns.available()
    if reason:
        _need(reason)
    base = tmp_path_factory.mktemp("ray")
    (base / "disk").mkdir()
    (base / "storage").mkdir()
    tag = uuid.uuid4().hex
    (base / "home").mkdir()  # Not the machine's: a ~/.ray/auth_token that a local ray.init() left fails
    # every `ray start` ("InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'").
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}, **QUIET_TF,
           "PYTHONPATH": ROOT, TAG_ENV: tag, "RAY_USAGE_STATS_ENABLED": "0", "HOME": str(base / "home")}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    with netns.two_hosts() as hosts:
        (head_ns, head_ip), (worker_ns, worker_ip) = hosts
        common = ["--num-cpus=1", "--disable-usage-stats"]
        nodes = [(head_ns, [ray_bin, "start", "--head", f"--node-ip-address={head_ip}", "--port=6379",
                            "--include-dashboard=true", f"--dashboard-host={head_ip}", *common]),  # The job API.
                 (worker_ns, [ray_bin, "start", f"--address={head_ip}:6379",
                              f"--node-ip-address={worker_ip}", *common])]
        try:
            for i, (name, command) in enumerate(nodes):
                script = f'mount -t tmpfs tmpfs {base / "disk"} && exec "$@"'
                started = subprocess.run(
                    ["ip", "netns", "exec", name, "unshare", "--mount", "--propagation", "private",
                     "bash", "-c", script, "bash", *command, f"--temp-dir=/tmp/dtf_ray_{tag[:8]}_{i}"],
                    env=env, capture_output=True, text=True, timeout=120)
                assert started.returncode == 0, started.stdout + started.stderr

            def run(argv, **kwargs):
                return subprocess.Popen(["ip", "netns", "exec", head_ns, sys.executable, *argv],
                                        env={**env, "RAY_ADDRESS": f"{head_ip}:6379"},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)

            yield run, base, tag
        finally:
            for pid in _tagged(tag):  # Ours only: every process of this cluster has the tag,
                _kill(pid)
            for pid in filter(str.isdigit, os.listdir("/proc")):  # or runs in its nodes' namespaces (Ray's
                if _in_namespace(int(pid), head_ns) or _in_namespace(int(pid), worker_ns):  # agents drop the tag).
                    _kill(int(pid))


def _tagged(tag: str, *, contains: str = "") -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{TAG_ENV}={tag}".encode() in environ.split(b"\0") and contains in cmdline:
            pids.append(int(entry))
    return pids


def _kill(pid: int):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finish(proc, timeout=600) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"the driver did not end in {timeout} s:\n{output[-4000:]}") from None
    return output


def _fingerprints(output: str) -> list[str]:
    return re.findall(r"worker:\d final weights sha256 (\w+)", output)


def test_main_job_on_two_nodes_then_a_killed_worker_resumes_from_the_backups(cluster):
    run, base, tag = cluster
    model_dir = base / "disk" / "run"
    driver = ["-m", "distrib_tf.deploy.ray_train", "--num_workers=2", "--max_failures=1",
              f"--storage_path={base / 'storage'}", "--name=main", "--",
              "--epochs=3", "--steps_per_epoch=40", "--backup_every_steps=10",
              "--collective_timeout=20", f"--model_dir={model_dir}"]
    proc = run(driver)
    # worker:1 is the rank on the worker node; its task writes its backups on that node's disk.
    deadline = time.monotonic() + 300
    child = None
    while time.monotonic() < deadline and proc.poll() is None:
        child = _task_process(tag, 1)
        if child and max(_backups(child, model_dir / "backup" / "worker-1"), default=0) > 0:
            break
        time.sleep(0.5)
    assert child and max(_backups(child, model_dir / "backup" / "worker-1"), default=0) > 0, (
        "no backup of worker:1 after step 0 in time")
    time.sleep(1.0)  # Into the next backup interval.
    backed_up = max(_backups(child, model_dir / "backup" / "worker-1"))
    ray_worker = _ppid(child)
    os.kill(ray_worker, signal.SIGKILL)  # The Ray worker of rank 1: Ray restarts the group.
    output = _finish(proc)
    assert proc.returncode == 0, output[-5000:]
    result = next(json.loads(line) for line in reversed(output.splitlines()) if line.startswith('{"metrics"'))
    checkpoint = result["checkpoint"]
    with open(os.path.join(checkpoint, "summary.json")) as f:
        summary = json.load(f)
    assert os.path.exists(os.path.join(checkpoint, "model.keras"))
    # Resumed from the backups both held, not from step 0, and trained to the end.
    assert 0 < backed_up <= summary["resumed_at_step"] < 120, (backed_up, summary["resumed_at_step"])
    assert re.search(r"worker:1 resumes at step \d+", output), output[-5000:]  # After Ray's restart.
    assert [e["epoch"] for e in summary["epochs"]][-1] == 3
    assert result["metrics"]["final"] is True and "accuracy" in result["metrics"]
    prints = _fingerprints(output)
    assert len(prints) >= 2 and len(set(prints[-2:])) == 1, prints  # From both nodes' tasks.
    assert summary["weights_sha256"] == prints[-1]


def _task_process(tag: str, index: int, program: bytes = b"distrib_tf.train") -> int | None:
    """The pid of the task `worker:index` (of the main job, or the script `program`) of the
    cluster tagged `tag`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            if program not in cmdline:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if environ.get(TAG_ENV.encode()) != tag.encode() or b"TF_CONFIG" not in environ:
            continue
        if json.loads(environ[b"TF_CONFIG"])["task"]["index"] == index:
            return int(entry)
    return None


def _backups(pid: int, directory) -> list[int]:
    """The steps backed up in `directory` as process `pid` sees its disk."""
    seen = f"/proc/{pid}/root{directory}"
    try:
        return [int(m.group(1)) for name in os.listdir(seen)
                if (m := re.match(r"step-(\d+)\.json$", name))]
    except OSError:
        return []


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_preemption_restarts_without_counting_a_failure_and_a_bad_flag_fails_at_once(cluster):
    run, base, tag = cluster
    model_dir = base / "storage" / "preempted"  # Where both nodes see it: the checks read it.
    driver = ["-m", "distrib_tf.deploy.ray_train", "--num_workers=2", "--max_failures=0",
              f"--storage_path={base / 'storage'}", "--name=preempted", "--",
              "--epochs=2", "--steps_per_epoch=30", "--backup_every_steps=5", f"--model_dir={model_dir}"]
    proc = run(driver)
    deadline = time.monotonic() + 300
    tasks = []
    while time.monotonic() < deadline and proc.poll() is None:
        tasks = [_task_process(tag, i) for i in (0, 1)]
        if all(tasks) and max(_backups(tasks[1], model_dir / "backup" / "worker-1"), default=0) > 0:
            break
        time.sleep(0.5)
    for pid in tasks:  # The scheduler's notice, to every task: each backs up and exits 75.
        os.kill(pid, signal.SIGTERM)
    output = _finish(proc)
    # No failure allowed (max_failures=0), yet Ray restarted the group: 75 is a preemption.
    assert proc.returncode == 0, output[-5000:]
    assert re.search(r"preempted: backed up step (\d+) like every worker", output), output[-5000:]
    assert "distrib_tf: every failed rank exited 75 (preempted): restart 1, not a failure" in output, output[-5000:]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["resumed_at_step"] > 0 and summary["epochs"][-1]["epoch"] == 2, summary

    bad = run(["-m", "distrib_tf.deploy.ray_train", "--num_workers=2", "--max_failures=3",
               f"--storage_path={base / 'storage'}", "--name=bad", "--", "--epochs=-1"])
    output = _finish(bad, timeout=300)
    assert bad.returncode == exit_codes.USAGE, output[-5000:]  # Not retried 3 times.
    assert "distrib_tf: a rank exited 2: not retried" in output, output[-3000:]


def test_a_users_keras_fit_trains_under_ray(cluster):
    run, base, _ = cluster
    out = base / "storage" / "user"
    output = _finish(run([RAY_USER, str(out), str(base / "storage")]))
    assert "USER RUN OK" in output, output[-5000:]
    weights = [np.load(out / f"rank{r}.npz") for r in (0, 1)]
    for name in weights[0].files:  # From the two nodes: one synchronous model.
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["legacy_keras_env"] is None  # Ray set it; make_strategy dropped it.
        assert report["tf_keras_is_keras_3"], report
        assert report["replicas"] == 2
    result = json.loads((out / "result.json").read_text())
    assert [m["epoch"] for m in result["history"]] == [1, 2], result  # One report per epoch.
    assert result["checkpoint_files"] == ["model.keras"], result  # Rank 0's model, by Ray.


@pytest.fixture(scope="module")
def uninterrupted(cluster):
    """A user's script (tests/workers/my_script.py) on 2 workers for 10 epochs, uninterrupted:
    `(its final weights' fingerprint, its model_dir)`, where the preempted and the elastic
    runs must end."""
    run, base, _ = cluster
    model_dir = base / "storage" / "reference"
    output = _finish(run(["-m", "distrib_tf.deploy.ray_train", "--num_workers=2", "--max_failures=0",
                          f"--storage_path={base / 'storage'}", "--name=reference", f"--script={MY_SCRIPT}",
                          "--", f"--model_dir={model_dir}", "--epochs=10"]))
    prints = _fingerprints(output)
    assert len(prints) == 2 and len(set(prints)) == 1, output[-5000:]  # From both nodes.
    return prints[0], model_dir


def test_a_users_script_on_the_run_api_is_preempted_and_restarted_under_ray(cluster, uninterrupted):
    """Issue 31: a user's script (tests/workers/my_script.py), not the main job, under
    `distrib-tf-ray --script`: SIGTERM to both tasks, each backs up and exits 75, Ray restarts
    the group as a preemption (`--max_failures=0`), the run resumes and ends on the weights
    of the uninterrupted run, from both nodes."""
    run, base, tag = cluster
    expected = {uninterrupted[0]}
    model_dir = base / "storage" / "mine"
    proc = run(["-m", "distrib_tf.deploy.ray_train", "--num_workers=2", "--max_failures=0",
                f"--storage_path={base / 'storage'}", "--name=mine", f"--script={MY_SCRIPT}", "--",
                f"--model_dir={model_dir}", "--epochs=10"])
    deadline, tasks = time.monotonic() + 300, []
    while time.monotonic() < deadline and proc.poll() is None:
        tasks = [_task_process(tag, i, MY_SCRIPT.encode()) for i in (0, 1)]
        if all(tasks) and max(_backups(tasks[1], model_dir / "backup" / "worker-1"), default=0) > 0:
            break
        time.sleep(0.2)
    for pid in tasks:
        os.kill(pid, signal.SIGTERM)
    output = _finish(proc)
    assert proc.returncode == 0, output[-5000:]
    assert re.search(r"preempted: backed up step (\d+) like every worker", output), output[-5000:]
    assert "every failed rank exited 75 (preempted): restart 1, not a failure" in output, output[-5000:]
    assert re.search(r"worker:\d resumes at step [1-9]", output), output[-5000:]
    assert set(_fingerprints(output)[-2:]) == expected, output[-5000:]  # Both nodes, the same weights.


def test_a_sweep_of_two_trials_as_ray_jobs_prunes_one(cluster):
    """Issue 52 item 1 on Ray: `distrib-tf-sweep --engine=ray`, each trial a Ray Train run of
    2 ranks (one per node) submitted through Ray's job API, the study a journal file on the
    disk both nodes see. The sweep is SIGKILLed after the first trial's first epoch: its job
    goes on (it is Ray's), and the same command follows it again. The grid's second trial
    (a learning rate of 0) is pruned after its first epoch by the median of the first, on
    both ranks, through the study; no trial runs twice."""
    run, base, _ = cluster
    sweep_dir = base / "storage" / "sweep"
    args = ["-m", "distrib_tf.experiments.sweep", "--engine=ray", f"--ray_address=http://{netns.SUBNET}.1:8265",
            "--workers_per_trial=2", f"--storage=journal:{base / 'storage' / 'study.log'}", f"--sweep_dir={sweep_dir}",
            "--space=learning_rate=[0.05,0.0]", "--pruner=median", "--pruner_startup_trials=1",
            "--metric=val_loss", "--mode=min", "--", "python", SWEPT, "--epochs=2"]
    killed = run(args)
    deadline = time.monotonic() + 300
    while not (found := glob.glob(f"{sweep_dir}/trial-*/events.jsonl")):
        assert time.monotonic() < deadline and killed.poll() is None, _finish(killed)[-5000:]
        time.sleep(0.2)
    while not any(e["event"] == "epoch" for e in events.read(found[0])):
        assert time.monotonic() < deadline and killed.poll() is None, _finish(killed)[-5000:]
        time.sleep(0.2)
    killed.kill()
    _finish(killed)
    output = _finish(run(args))
    assert re.search(r"trial 0 \{'learning_rate': 0.05\}: its job ray:\S+ followed again", output), output[-5000:]
    assert "sweep: 2/2 ended (1 pruned, 0 failed)" in output, output[-5000:]
    with open(sweep_dir / "results.csv", encoding="utf-8") as f:
        rows = {float(row["learning_rate"]): row for row in csv.DictReader(f)}
    assert {k: (r["status"], r["epochs"]) for k, r in rows.items()} == {
        0.05: ("finished", "2"), 0.0: ("pruned", "1")}, output[-5000:]
    with open(os.path.join(rows[0.0]["model_dir"], "trial.log"), encoding="utf-8") as f:
        pruned = f.read()
    for task in ("worker:0", "worker:1"):  # Both ranks, at one step, with the pruned code, not retried.
        assert f"{task} pruned by the sweep after epoch 1: backed up step 16 like every worker" in pruned, pruned
    assert "a rank exited 3: not retried" in pruned, pruned[-3000:]
    with open(os.path.join(rows[0.05]["model_dir"], "trial.log"), encoding="utf-8") as f:
        finished = f.read()
    assert finished.count("$ ") == 1 and "resumes at step" not in finished, finished[-3000:]  # One job, once.
    seen = {os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{rows[0.05]['model_dir']}/seen/*/end.json")}
    assert seen == {"worker_0", "worker_1"}, seen


def _in_namespace(pid: int, namespace: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{namespace}").st_ino
    except OSError:
        return False


def test_an_elastic_run_loses_a_node_goes_on_with_one_and_ends_on_the_uninterrupted_weights(cluster, uninterrupted):
    """Issue 32: `--num_workers=1:2` (Ray Train's elastic group). The worker node dies mid-run
    (every process of it SIGKILLed); Ray restarts the group with the one worker it can have,
    which resumes from its node's backup of worker:0 (a task the new layout does not have)
    and ends within the float64 layout bound of the uninterrupted 2-worker run."""
    from cluster_runner import checkpoint_arrays  # pylint: disable=import-outside-toplevel
    from cluster_runner import weights_difference  # pylint: disable=import-outside-toplevel

    run, base, tag = cluster
    common = ["-m", "distrib_tf.deploy.ray_train", "--max_failures=1", f"--storage_path={base / 'storage'}",
              f"--script={MY_SCRIPT}"]
    reference_dir = uninterrupted[1]
    model_dir = base / "storage" / "elastic"
    proc = run([*common, "--num_workers=1:2", "--name=elastic", "--", f"--model_dir={model_dir}", "--epochs=10"])
    deadline, worker = time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        worker = _task_process(tag, 1, MY_SCRIPT.encode())
        if worker and max(_backups(worker, model_dir / "backup" / "worker-1"), default=0) > 0:
            break
        time.sleep(0.2)
    assert worker, "worker:1 never backed up"
    namespace = next(n for n in os.listdir("/run/netns") if _in_namespace(worker, n))
    for pid in _tagged(tag):  # The node is lost: its raylet, its Ray workers, the task.
        if _in_namespace(pid, namespace):
            _kill(pid)
    output = _finish(proc)
    assert proc.returncode == 0, output[-5000:]
    assert re.search(r"chief:0 resumes at step [1-9]\d* .*a task this layout does not have", output), output[-5000:]
    difference = weights_difference(checkpoint_arrays(model_dir / "checkpoints" / "epoch010.weights.h5"),
                                    checkpoint_arrays(reference_dir / "checkpoints" / "epoch010.weights.h5"))
    print(f"elastic: a node lost, the run went on with 1 worker: weights {difference:.2g} from 2 uninterrupted")
    assert difference <= 1e-10  # tests/test_train.py, LAYOUT_CASES (float64).


def test_a_sweep_refuses_a_ray_address_without_a_job_api_in_one_line(tmp_path):
    with socket.socket() as s:  # A port nothing listens on.
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.experiments.sweep", "--engine=ray", f"--ray_address=http://127.0.0.1:{port}",
         f"--storage=journal:{tmp_path}/study.log", f"--sweep_dir={tmp_path}/sweep", "--space=units=[4]",
         "--", "python", SWEPT], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert result.returncode == exit_codes.USAGE and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and (
        f"Invalid value for `--ray_address`. Received: http://127.0.0.1:{port} (") in result.stderr, result.stderr
    assert not (tmp_path / "sweep").exists()
