"""Slurm: the cluster of a step from SLURM_*, real jobs on one node and across two nodes.

The job tests need root and Debian's slurm-wlm. The one-node cluster is the one `.ci/run`
starts (`scripts/slurm_local.sh`, SLURM_CONF set); the two-node cluster is started here
(`scripts/slurm_two_nodes.sh`). They skip without Slurm, except when
DISTRIB_TF_REQUIRE_SLURM=1 (CI), where they fail.
"""

import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import postgres as postgres_lib
from cluster_runner import QUIET_TF
from distrib_tf import events
from distrib_tf.cluster import ClusterSpecError
from distrib_tf.deploy import slurm

ROOT = os.path.dirname(os.path.dirname(__file__))
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
LAUNCH = [sys.executable, "-m", "distrib_tf.launch", "--slurm", "--"]
STEP = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu07,gpu08", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "1", "SLURM_LOCALID": "1"}


def _need_slurm(why: str):
    if os.environ.get("DISTRIB_TF_REQUIRE_SLURM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def test_cluster_of_a_step_with_reserved_ports():
    spec, task = slurm.load_cluster({**STEP, "SLURM_STEP_RESV_PORTS": "12007-12009"})
    assert str(task) == "worker:3"
    assert spec.jobs["worker"] == ("gpu07:12007", "gpu07:12008", "gpu08:12007", "gpu08:12008")
    one_node = {**STEP, "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "4",
                "SLURM_NODEID": "0", "SLURM_LOCALID": "3", "SLURM_STEP_RESV_PORTS": "12000,12002-12004"}
    assert slurm.load_cluster(one_node)[0].jobs["worker"] == (
        "127.0.0.1:12000", "127.0.0.1:12002", "127.0.0.1:12003", "127.0.0.1:12004")


def test_fallback_ports_differ_between_steps_and_nearby_jobs_and_avoid_ephemeral_ports():
    blocks = {}
    for job in range(1000, 1100):
        for step in range(4):
            ports = slurm.step_ports({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)}, 3)
            assert all(slurm.PORT_RANGE[0] <= p < slurm.PORT_RANGE[1] for p in ports)
            blocks[(job, step)] = set(ports)
    taken = [port for ports in blocks.values() for port in ports]
    assert len(taken) == len(set(taken)) == 100 * 4 * 3
    # The old scheme, 20000 + 16 * (job mod 1000), put jobs 1000 ids apart on one block.
    assert slurm.step_ports({"SLURM_JOB_ID": "5"}, 2) != slurm.step_ports({"SLURM_JOB_ID": "1005"}, 2)


def test_local_rank_from_slurm():
    assert slurm.local_rank(STEP) == (1, 2)
    assert slurm.local_rank({}) is None
    with pytest.raises(ValueError, match="Expected a local id below this node's task count"):
        slurm.local_rank({**STEP, "SLURM_LOCALID": "2"})


def test_hostlists_in_every_form_slurm_writes(tmp_path, monkeypatch):
    if shutil.which("scontrol") is None:
        _need_slurm("needs Slurm's scontrol (apt-get install slurm-wlm)")
    conf = tmp_path / "slurm.conf"  # scontrol reads a configuration, even to expand names.
    conf.write_text("ClusterName=hostlists\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert slurm.hostnames("rack[1-2]-n[01-02],login,x[7,9-10]") == [
        "rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02", "login", "x7", "x9", "x10"]
    with pytest.raises(ClusterSpecError, match=r"Received: 'a\[7,9-10\]b'.*\(Invalid hostlist"):
        slurm.hostnames("a[7,9-10]b")


def _one_node_slurm():
    if not (shutil.which("srun") and os.environ.get("SLURM_CONF") and subprocess.run(
            ["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0):
        _need_slurm("no Slurm here: start one with scripts/slurm_local.sh (root) and set SLURM_CONF")


def _train(model_dir, *flags):
    return [sys.executable, "-m", "distrib_tf.train", "--epochs=1", "--steps_per_epoch=5",
            f"--model_dir={model_dir}", *flags]


def _started_at(output: str) -> list[str]:
    return re.findall(r"^\[launcher\] started worker:\d \(pid \d+\) at (\S+)", output, re.M)


@pytest.mark.multiworker
@pytest.mark.slow  # 28 s: make soak (make test-engines runs a step on the two nodes).
def test_two_jobs_at_once_on_one_node_get_their_own_ports(tmp_path):
    _one_node_slurm()
    jobs = [subprocess.Popen(["srun", "-n", "2", "--oversubscribe", "--kill-on-bad-exit=1", "--time=10",
                              *LAUNCH, *_train(tmp_path / f"run{i}")],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [job.communicate(timeout=400)[0] for job in jobs]
    for job, output in zip(jobs, outputs):
        assert job.returncode == 0, output[-3000:]
        assert "[worker:0] final accuracy" in output
    ports = [_started_at(output) for output in outputs]
    assert all(len(p) == 2 for p in ports) and not set(ports[0]) & set(ports[1]), ports
    low, high = slurm.PORT_RANGE  # No reservation on this cluster: the fallback range.
    assert all(low <= int(a.rpartition(":")[2]) < high for a in ports[0] + ports[1]), ports
    for i in range(2):
        with open(tmp_path / f"run{i}" / "summary.json") as f:
            assert json.load(f)["workers"] == 2


@pytest.fixture
def two_nodes(tmp_path):
    """A two-node Slurm in network and UTS namespaces; yields the `run` command prefix."""
    if os.geteuid() != 0 or not shutil.which("slurmd") or not shutil.which("ip"):
        _need_slurm("the two-node Slurm needs root, slurm-wlm and iproute2")
    script = os.path.join(ROOT, "scripts", "slurm_two_nodes.sh")
    scratch = tmp_path / "slurm"
    started = subprocess.run([script, "start", str(scratch)], capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield [script, "run", str(scratch), "--"]
    finally:
        subprocess.run([script, "stop", str(scratch)], capture_output=True, timeout=60)


@pytest.mark.multiworker
@pytest.mark.slow  # 32 s: make soak. make test-engines runs a step of 2 tasks on the 2 nodes, preempted, resumed.
def test_main_job_across_two_nodes_two_tasks_each(tmp_path, two_nodes):
    show = "echo PLACED $(hostname) $SLURM_PROCID $LOCAL_RANK $LOCAL_WORLD_SIZE; exec \"$@\""
    result = subprocess.run(
        [*two_nodes, "srun", "-N", "2", "-n", "4", "--kill-on-bad-exit=1", "--time=10", *LAUNCH,
         "bash", "-c", show, "bash", *_train(tmp_path / "run")],
        env=ENV, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    placed = sorted(tuple(line.split()[2:]) for line in result.stdout.splitlines() if "] PLACED " in line)
    assert placed == [("dtf-n1", "0", "0", "2"), ("dtf-n1", "1", "1", "2"),
                      ("dtf-n2", "2", "0", "2"), ("dtf-n2", "3", "1", "2")]
    addresses = _started_at(result.stdout)
    hosts = sorted(a.rpartition(":")[0] for a in addresses)
    assert hosts == ["dtf-n1", "dtf-n1", "dtf-n2", "dtf-n2"], addresses
    assert all(12000 <= int(a.rpartition(":")[2]) <= 12999 for a in addresses)  # Reserved by Slurm.
    hashes = set(re.findall(r"final weights sha256 (\w+)", result.stdout))
    assert len(re.findall(r"final weights sha256", result.stdout)) == 4 and len(hashes) == 1
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    assert summary["workers"] == 4 and summary["strategy"] == "MultiWorkerMirroredStrategy"


def _srun_options() -> list[str]:
    """The options the exported batch script passes srun."""
    srun = next(line for line in slurm.batch_script(None, nodes=(1, 2), command=["true"]).splitlines()
                if line.startswith("srun "))
    return srun.split()[1:srun.split().index("distrib-tf-launch")]


def _preempted_step(prefix, srun_args, train, *, name, marker) -> int:
    """Runs `srun SRUN_ARGS ... LAUNCH TRAIN` (under `prefix`, a Slurm of its own), sends its
    tasks SIGTERM (`scancel --signal=TERM`, as a time limit's `--signal=TERM@120` does) once
    `marker` is printed; checks that worker:0 and worker:1 backed up one step and that the
    step exited 75; returns that step."""
    job = subprocess.Popen([*prefix, "srun", *srun_args, f"--job-name={name}", "--time=10", *_srun_options(),
                            *LAUNCH, *train], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in job.stdout:
            lines.append(line)
            if marker in line:
                break
        assert job.poll() is None, "".join(lines)[-3000:]
        job_id = subprocess.run([*prefix, "squeue", "-h", "-n", name, "-o", "%i"], env=ENV, capture_output=True,
                                text=True, timeout=30).stdout.split()[0]
        subprocess.run([*prefix, "scancel", "--signal=TERM", job_id], env=ENV, check=True, timeout=30)
        output = "".join(lines) + job.communicate(timeout=200)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    saved = set(re.findall(r"(worker:\d) preempted: backed up step (\d+) like every worker", output))
    assert {task for task, _ in saved} == {"worker:0", "worker:1"} and len({s for _, s in saved}) == 1, output[-3000:]
    assert job.returncode == 75, output[-3000:]
    return int(saved.pop()[1])


@pytest.mark.engines  # make test-engines (50 s), on the one-node Slurm.
@pytest.mark.multiworker
def test_a_preemption_under_srun_saves_on_every_task_and_exits_75(tmp_path):
    """Issue 33 item 5, played on the one-node Slurm: SIGTERM to every task of a running step
    with the srun options of `distrib-tf-export slurm` (`--wait`, no `--kill-on-bad-exit`):
    both back up one step, 75."""
    _one_node_slurm()
    _preempted_step([], ["-n", "2", "--oversubscribe"], _train(tmp_path / "run", "--epochs=3", "--steps_per_epoch=100"),
                    name=f"preempt-{os.getpid()}", marker="worker:1 epoch 1/3")


@pytest.mark.engines  # make test-engines: two Slurm nodes, a preemption, a resume on one (about 1 min).
@pytest.mark.multiworker
def test_a_step_on_fewer_nodes_resumes_at_the_step_every_worker_backed_up(tmp_path, two_nodes):
    """Issue 32 on Slurm: a job step on two nodes (one task each, the batch script's srun
    options) gets SIGTERM in its first epoch (a preemption's warning): both tasks back up one
    step, 75. The next allocation has one node (a requeue of `distrib-tf-export slurm
    --nodes=1-2`, or any job on the same `--model_dir`): its one task resumes at that step."""
    model_dir = tmp_path / "run"
    train = _train(model_dir, "--epochs=2", "--steps_per_epoch=30", "--backup_every_steps=5")
    step = _preempted_step(two_nodes, ["-N", "2", "--ntasks-per-node=1"], train, name=f"elastic-{os.getpid()}",
                              marker="worker:1 epoch 1/2")
    resumed = subprocess.run([*two_nodes, "srun", "-N", "1", "-n", "1", "--time=10", *_srun_options(), *LAUNCH, *train],
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert re.search(rf"(chief|worker):0 resumes at step {step} ", resumed.stdout), resumed.stdout[-3000:]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["resumed_at_step"] == step, summary


SWEPT = os.path.join(ROOT, "tests", "workers", "swept_script.py")
STATES = ("import json, sys, optuna; study = optuna.load_study(study_name='distrib_tf', storage=sys.argv[1]); "
          "print(json.dumps([[t.number, t.state.name, t.user_attrs.get('job')] for t in study.trials]))")


def _rows(sweep_dir) -> dict:
    with open(os.path.join(sweep_dir, "results.csv"), encoding="utf-8") as f:
        return {float(row["learning_rate"]): row for row in csv.DictReader(f)}


def _text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _weights(trial_dir) -> list:
    with open(os.path.join(trial_dir, "seen", "worker_0", "end.json"), encoding="utf-8") as f:
        return json.load(f)["weights"]


@pytest.mark.engines  # make test-engines: a sweep of 4 two-node trials, SIGKILLed and started again.
@pytest.mark.multiworker
def test_a_sweep_on_two_nodes_killed_follows_its_jobs_again_and_runs_each_once(tmp_path, two_nodes):
    """Issue 52 item 1 on Slurm: `distrib-tf-sweep --engine=slurm` on the two-node Slurm, the
    study in PostgreSQL on node 1's address, each trial a batch job of 2 workers, one per
    node, a median pruner. The sweep is SIGKILLed at trial 0's first epoch's end: its job goes on
    (it is Slurm's); the same command started again follows it, then runs the rest. Every
    trial ran once (one job each, never resubmitted), the learning rate of 0 is pruned
    through the study, and trial 0 ends bit-identical to the same values on one host."""
    try:
        with postgres_lib.server(listen="10.81.0.1", netns="dtfslurm1", clients="10.81.0.0/24") as url:
            _sweep_on_two_nodes(tmp_path, two_nodes, url)
    except postgres_lib.Unavailable as e:
        if os.environ.get("DISTRIB_TF_REQUIRE_POSTGRES") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))


def _sweep_on_two_nodes(tmp_path, two_nodes, url):
    script = ["--", "python", SWEPT, "--epochs=2", "--float64"]  # Killed, its chief waits for the word: mid-trial.
    args = [sys.executable, "-m", "distrib_tf.experiments.sweep", "--engine=slurm", "--workers_per_trial=2",
            "--nodes_per_trial=2", f"--storage={url}", f"--sweep_dir={tmp_path}/sweep",
            "--space=learning_rate=[0.05,0.02,0.001,0.0]", "--pruner=median", "--pruner_startup_trials=1",
            "--metric=val_loss", "--mode=min", *script]
    killed = subprocess.Popen([*two_nodes, *args], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    one_host = subprocess.Popen(  # Meanwhile, the same values on this host: the reference.
        [sys.executable, "-m", "distrib_tf.experiments.sweep", f"--sweep_dir={tmp_path}/one_host",
         "--space=learning_rate=[0.05]", "--metric=val_loss", "--mode=min", *script],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not glob.glob(f"{tmp_path}/sweep/trial-*/events.jsonl"):
            assert time.monotonic() < deadline and killed.poll() is None
            time.sleep(0.2)
        follower = events.Follower(glob.glob(f"{tmp_path}/sweep/trial-*/events.jsonl")[0])
        while not any(e["event"] == "epoch" and e.get("task") == "worker:0" for e in follower()):  # Epoch 1 ended.
            assert time.monotonic() < deadline and killed.poll() is None
            time.sleep(0.1)
        killed.kill()
        killed.wait()
        again = subprocess.run([*two_nodes, *args], env=ENV, capture_output=True, text=True, timeout=900)
        reference, _ = one_host.communicate(timeout=300)
    finally:
        for proc in (killed, one_host):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert one_host.returncode == 0, reference[-3000:]
    assert re.search(r"trial 0 \{'learning_rate': 0.05\}: its job slurm:\d+ followed again", again.stdout), again.stdout
    assert "sweep: 4/4 ended" in again.stdout and "0 failed" in again.stdout, again.stdout
    rows = _rows(tmp_path / "sweep")
    assert rows[0.05]["status"] == "finished" and rows[0.0]["status"] == "pruned", again.stdout
    assert {row["status"] for row in rows.values()} <= {"finished", "pruned"}, again.stdout
    for row in rows.values():  # One job a trial, its 2 workers on the 2 nodes.
        log = _text(os.path.join(row["model_dir"], "trial.log"))
        hosts = sorted(a.rpartition(":")[0] for a in _started_at(log))
        assert hosts == ["dtf-n1", "dtf-n2"], log[-3000:]
    pruned = _text(os.path.join(rows[0.0]["model_dir"], "trial.log"))
    assert "worker:1 pruned by the sweep after epoch 1" in pruned, pruned[-3000:]
    states = subprocess.run([*two_nodes, sys.executable, "-c", STATES, url], env=ENV, capture_output=True, text=True,
                            timeout=120)
    trials = json.loads(states.stdout)
    assert len(trials) == 4 and {state for _, state, _ in trials} <= {"COMPLETE", "PRUNED"}, trials  # None twice.
    assert len({job for _, _, job in trials}) == 4, trials
    expected = _weights(os.path.dirname(glob.glob(f"{tmp_path}/one_host/trial-*/events.jsonl")[0]))
    assert _weights(rows[0.05]["model_dir"]) == expected  # Bit for bit: the same arithmetic on two nodes.


@pytest.mark.engines
@pytest.mark.parametrize("flags, env, message", [
    (["--engine=k8s"], {}, "argument --engine: invalid choice: 'k8s' (choose from 'local', 'slurm'"),
    (["--engine=slurm"], {"PATH": os.path.dirname(sys.executable)},
     "Invalid value for `--engine`. Received: slurm, but no sbatch, squeue, scontrol, scancel on PATH."),
    (["--engine=slurm"], {}, "Invalid value for `--storage`. Received: sqlite:///{sweep}/study.db (the default) "
                             "with --engine=slurm. Expected a study every node reaches"),
    (["--engine=slurm", "--storage=sqlite:///{sweep}.db"], {}, "Received: sqlite:///{sweep}.db with --engine=slurm."),
    (["--nodes_per_trial=2"], {}, "Invalid value for `--nodes_per_trial`. Received: 2. Expected it only with an "
                                  "engine that spreads a trial over nodes"),
])
def test_a_sweep_refuses_an_engine_it_cannot_use_in_one_line(tmp_path, flags, env, message):
    if "PATH" not in env and "slurm" in "".join(flags) and not shutil.which("sbatch"):
        _need_slurm("needs Slurm's commands (apt-get install slurm-wlm)")
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "distrib_tf.experiments.sweep", f"--sweep_dir={sweep_dir}", "--space=units=[4]",
         *(flag.format(sweep=sweep_dir) for flag in flags), "--", "python", SWEPT],
        capture_output=True, text=True, env={**ENV, **env}, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and message.format(sweep=sweep_dir) in result.stderr, result.stderr
    assert not sweep_dir.exists()  # Nothing started.
