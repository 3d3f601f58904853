"""The run API for a user's own script (tests/workers/my_script.py), not the main job: a
functional model with two inputs and two outputs, AdamW under a schedule, a callback of its
own, data from arrays with a float target, on 2 real workers.

The preemption test gives each worker its own disk: a directory of its own bind-mounted at
`model_dir` in a mount namespace of its own (root only; `.ci/run` makes it required with
`DISTRIB_TF_REQUIRE_NETNS=1`), so no worker can read what another wrote.
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

from cluster_runner import QUIET_TF
from cluster_runner import checkpoint_arrays
from cluster_runner import finished_backups
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_single
from cluster_runner import weights_difference

ROOT = os.path.dirname(os.path.dirname(__file__))
SCRIPT = os.path.join(ROOT, "tests", "workers", "my_script.py")
ENV = {**os.environ, **QUIET_TF, "PYTHONPATH": ROOT}
LAUNCH = [sys.executable, "-m", "distrib_tf.launch", "--workers=2"]
STEPS = 48  # 3 epochs of 16 steps (tests/workers/my_script.py).

pytestmark = pytest.mark.multiworker


def _fingerprints(text):
    return dict(re.findall(r"(worker:\d) final weights sha256 (\w+)", text))


def _launch(*args, extra=(), timeout=300, script=SCRIPT):
    result = subprocess.run([*LAUNCH, *extra, "--", sys.executable, script, *map(str, args)], env=ENV,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of the run never interrupted, as each worker's process computed them."""
    model_dir = tmp_path_factory.mktemp("uninterrupted")
    code, text = _launch(f"--model_dir={model_dir}")
    assert code == 0, text[-3000:]
    weights = _fingerprints(text)
    assert sorted(weights) == ["worker:0", "worker:1"] and len(set(weights.values())) == 1, text[-3000:]
    assert "worker:0 after the run" in text and "worker:1 after the run" in text, text[-3000:]  # No os._exit.
    pytest.uninterrupted_dir = model_dir  # Its chief's last checkpoint, for the layout test.
    return weights["worker:0"]


def _require_own_disks():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        if os.environ.get("DISTRIB_TF_REQUIRE_NETNS"):
            pytest.fail("needs root and unshare for a disk per worker")
        pytest.skip("needs root and unshare for a disk per worker")


def _own_disks_cluster(tmp_path, disks, model_dir, args, timeout=300):
    """One process per task, each seeing only its own disk at `model_dir`."""
    spec = local_spec(len(disks)).with_free_ports()
    procs = []
    for task, disk in zip(spec.tasks, disks):
        mount = f'mount --bind {disk} {model_dir} && exec "$@"'
        procs.append(subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", mount, "bash",
             sys.executable, SCRIPT, f"--model_dir={model_dir}", *args],
            env={**ENV, "TF_CONFIG": spec.tf_config(task)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return [p.returncode for p in procs], outputs


@pytest.mark.slow  # 18 s: make soak. make test: own disks in test_a_grow_onto_an_empty_disk..., bit-identical
def test_preempted_at_a_random_step_on_own_disks_resumes_to_bit_identical_weights(tmp_path, uninterrupted):  # resumes.
    _require_own_disks()
    model_dir = tmp_path / "run"
    disks = [tmp_path / f"disk{i}" for i in range(2)]
    for directory in (model_dir, *disks):
        directory.mkdir()
    step = random.Random().randrange(2, STEPS - 4)  # Drawn anew each run; printed below.
    codes, texts = _own_disks_cluster(tmp_path, disks, model_dir, [f"--sigterm_at_step={step}"])
    assert codes == [75, 75], (step, [t[-2000:] for t in texts])
    saved = {int(s) for t in texts for s in re.findall(r"preempted: backed up step (\d+) like every worker", t)}
    assert len(saved) == 1, (step, saved)  # One step, agreed by both.
    saved_step = saved.pop()
    assert step <= saved_step <= step + 2, (step, saved_step)
    codes, texts = _own_disks_cluster(tmp_path, disks, model_dir, [])
    assert codes == [0, 0], [t[-3000:] for t in texts]
    for text in texts:
        assert re.search(rf"worker:\d resumes at step {saved_step} ", text), text[-3000:]
    weights = [_fingerprints(text) for text in texts]
    assert weights == [{"worker:0": uninterrupted}, {"worker:1": uninterrupted}], weights  # Bit-identical.
    # The chief's outputs on its own disk only; every backup gone once the run ended.
    assert (disks[0] / "summary.json").exists() and (disks[0] / "model.keras").exists()
    assert not (disks[1] / "model.keras").exists()
    assert finished_backups(disks[1]) == {"worker-1": [(STEPS, True)]}  # Its last, on its own disk.
    summary = json.loads((disks[0] / "summary.json").read_text())
    assert summary["resumed_at_step"] == saved_step and summary["weights_sha256"] == uninterrupted
    print(f"user script: SIGTERM after step {step}, both backed up step {saved_step} on their own disks, "
          f"resumed: final weights bit-identical to the uninterrupted run ({uninterrupted})")


@pytest.mark.slow  # 20 s: make soak. make test restarts a killed worker of the main job (tests/test_launch.py).
def test_a_worker_killed_restarts_to_the_same_weights(tmp_path, uninterrupted):
    step = random.Random().randrange(6, STEPS - 4)
    code, text = _launch(f"--model_dir={tmp_path / 'run'}", f"--kill_at_step={step}",
                         f"--kill_marker={tmp_path / 'killed'}", extra=["--max_restarts=1", "--grace_period=5"])
    assert code == 0, (step, text[-3000:])
    assert "worker:1 was killed by SIGKILL" in text, text[-3000:]
    resumed = {int(s) for s in re.findall(r"worker:\d resumes at step (\d+)", text)}
    assert len(resumed) == 1 and 0 < resumed.pop() <= step, (step, text[-3000:])  # A backup every 5 steps.
    assert set(_fingerprints(text).values()) == {uninterrupted}, (step, text[-3000:])


def _error_lines(text):
    return [line for line in text.splitlines() if ": error: " in line]


def test_an_inf_in_one_workers_batch_stops_both_at_one_step_naming_it(tmp_path):
    results = run_cluster([SCRIPT, f"--model_dir={tmp_path / 'run'}", "--inf_at_step=7"], spec=local_spec(2),
                          env={"PYTHONPATH": ROOT}, timeout=240)
    expected = ("Non-finite loss or gradient at step 7 (epoch 1); NaN or Inf first seen in the input batch of "
                "worker:1. Every worker stopped at this step.")
    for result in results:
        assert result.returncode == 65, (result.task, result.output[-3000:])
        lines = _error_lines(result.output)
        assert len(lines) == 1 and expected in lines[0], result.output[-3000:]
        assert "Traceback" not in result.output


def test_rollback_under_a_schedule_goes_on_and_survives_a_restart(tmp_path):
    """An Inf read once (a bad read): the run rolls back to step 10, halves the scheduled
    learning rate and finishes, with the same weights on both workers. The same run
    preempted at step 20, after the rollback, and started again ends on those weights:
    the halved schedule and the rollback count are in the backups (issue 42 item 6: the
    restart went on with the full schedule, and counted rollbacks from 0)."""
    flags = ["--inf_at_step=12", "--flaky", "--on_nan=rollback"]

    def run(name, *more):
        return run_cluster([SCRIPT, f"--model_dir={tmp_path / name}", *flags, f"--out={tmp_path / name / 'out'}",
                            *more], spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=240)

    results = run("run")
    for result in results:
        assert result.returncode == 0, (result.task, result.output[-3000:])
        rolled = [line for line in result.output.splitlines() if "Rolled back to step" in line]
        assert len(rolled) == 1 and "Non-finite loss or gradient at step 12" in rolled[0], result.output[-3000:]
        assert "Rolled back to step 10; learning rate halved to" in rolled[0]
    seen = [json.loads((tmp_path / "run" / "out" / f"worker_{i}.json").read_text()) for i in (0, 1)]
    assert seen[0]["weights"] == seen[1]["weights"]
    assert [r["at_step"] for r in seen[0]["rollbacks"]] == [12] and seen[0]["epochs_seen"] == [1, 2, 3]

    preempted = run("preempted", "--sigterm_at_step=20")
    assert [r.returncode for r in preempted] == [75, 75], [r.output[-2000:] for r in preempted]
    assert all("Rolled back to step 10" in r.output for r in preempted)
    restarted = run("preempted")
    assert [r.returncode for r in restarted] == [0, 0], [r.output[-2000:] for r in restarted]
    assert all(re.search(r"worker:\d resumes at step 2\d ", r.output) for r in restarted), restarted[0].output[-2000:]
    again = json.loads((tmp_path / "preempted" / "out" / "worker_0.json").read_text())
    assert again["weights"] == seen[0]["weights"], (again["weights"], seen[0]["weights"])  # Bit-identical.
    assert [r["at_step"] for r in again["rollbacks"]] == [12]  # Counted once, across the restart.


def test_the_main_job_runs_a_users_model_and_data_by_name(tmp_path):
    """`--model=package.module:function` and `--dataset=package.module:function` under the launcher."""
    model_dir = tmp_path / "run"
    result = subprocess.run(
        [*LAUNCH, "--", sys.executable, "-m", "distrib_tf.train", "--model=tests.workers.my_models:build",
         "--dataset=tests.workers.my_models:splits", "--epochs=2", "--backup_every_steps=5",
         f"--model_dir={model_dir}"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["workers"] == 2 and [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert {"value_mae", "kind_accuracy"} <= set(summary["final"]), summary["final"]
    assert summary["epochs"][1]["value_loss"] < summary["epochs"][0]["value_loss"]  # It trains.
    assert len(set(_fingerprints(result.stdout).values())) == 1


@pytest.mark.slow  # 25 s: make soak. make test-engines plays 2 -> 1 on Slurm and on a JobSet.
def test_preempted_on_two_workers_resumes_on_one_process_where_the_uninterrupted_run_ends(tmp_path, uninterrupted):
    """Issue 32's first case: `--workers=1` on a directory that 2 workers wrote started
    again from step 0 without a word. The single process resumes from a gone task's backup;
    the arithmetic of 1 replica against 2 differs only by float64 rounding."""
    model_dir = tmp_path / "run"
    code, text = _launch(f"--model_dir={model_dir}", "--sigterm_at_step=20")
    assert code == 75, text[-3000:]
    step = int(re.search(r"preempted: backed up step (\d+)", text).group(1))
    single = run_single([SCRIPT, f"--model_dir={model_dir}"], env={"PYTHONPATH": ROOT}, timeout=240)
    assert single.returncode == 0, single.output[-3000:]
    assert f"chief:0 resumes at step {step} " in single.output, single.output[-3000:]
    difference = weights_difference(
        checkpoint_arrays(model_dir / "checkpoints" / "epoch003.weights.h5"),
        checkpoint_arrays(pytest.uninterrupted_dir / "checkpoints" / "epoch003.weights.h5"))
    print(f"2 workers preempted at step {step}, resumed on 1 process: weights {difference:.2g} (relative L2) "
          "from the uninterrupted 2-worker run")
    assert difference <= 1e-10  # The layout test's float64 bound (tests/test_train.py, LAYOUT_CASES).
    assert finished_backups(model_dir) == {"chief-0": [(STEPS, True)]}  # The gone tasks' went at the end.


@pytest.mark.slow  # 45 s: make soak. make test resizes 2-1-2 and grows onto an empty disk (a holder slow to load).
def test_a_grow_from_two_workers_to_three_the_new_one_on_an_empty_disk(tmp_path):
    """Preempted on 2 workers with their own disks inside the epoch, resumed on 3: worker:2's
    disk is empty, it gets the step and the state from worker:0 over the collective, while
    worker:1 loads its own backup, whose metadata (its own metric sums) differs in length
    from worker:0's (issue 53: a shape mismatch in the collective). A global batch of 48 (24
    a replica on 2, 16 on 3), one epoch of 10 steps; the result is the uninterrupted
    2-worker run's within the float64 layout bound."""
    _require_own_disks()
    args = ["--global_batch_size=48", "--epochs=1"]  # 10 steps.
    reference = tmp_path / "uninterrupted"
    code, text = _launch(f"--model_dir={reference}", *args)
    assert code == 0, text[-3000:]
    model_dir = tmp_path / "run"
    disks = [tmp_path / f"disk{i}" for i in range(3)]
    for directory in (model_dir, *disks):
        directory.mkdir()
    step = random.Random().randrange(2, 8)  # The backup (at most 2 steps later) inside the epoch.
    codes, texts = _own_disks_cluster(tmp_path, disks[:2], model_dir, [f"--sigterm_at_step={step}", *args])
    assert codes == [75, 75], (step, [t[-2000:] for t in texts])
    saved = int(re.search(r"backed up step (\d+) like every worker", texts[0]).group(1))
    assert 0 < saved < 10, (step, saved)
    codes, texts = _own_disks_cluster(tmp_path, disks, model_dir, args)
    assert codes == [0, 0, 0], [t[-3000:] for t in texts]
    assert f"worker:2 resumes at step {saved} " in texts[2] and "the state came from a worker" in texts[2], (
        texts[2][-3000:])
    weights = {w for text in texts for w in _fingerprints(text).values()}
    assert len(weights) == 1, weights  # Three processes, one set of weights.
    difference = weights_difference(checkpoint_arrays(disks[0] / "checkpoints" / "epoch001.weights.h5"),
                                    checkpoint_arrays(reference / "checkpoints" / "epoch001.weights.h5"))
    print(f"2 workers preempted at step {saved}, resumed on 3 (worker:2 on an empty disk): weights {difference:.2g} "
          "(relative L2) from the uninterrupted 2-worker run")
    assert difference <= 1e-10  # The layout test's float64 bound (tests/test_train.py, LAYOUT_CASES).


def _saved_step(text):
    return int(re.search(r"preempted: backed up step (\d+)", text).group(1))


def test_two_workers_then_one_process_then_two_resume_at_the_newest_step(tmp_path, uninterrupted):
    """Issue 42: 2 workers preempted, 1 process preempted later, 2 workers again on the same
    disk. The single process's directory (chief-0, a task the last layout does not have) holds
    the newest step, which wins: before, each worker's own directory still held the first
    preemption's step and they resumed there, the single process's steps dropped without a
    word (with own disks, where nothing is deleted, test_backup.py)."""
    model_dir = tmp_path / "run"
    code, text = _launch(f"--model_dir={model_dir}", "--sigterm_at_step=8")
    assert code == 75, text[-3000:]
    first = _saved_step(text)
    single = run_single([SCRIPT, f"--model_dir={model_dir}", "--sigterm_at_step=30", "--sigterm_task=chief:0"],
                        env={"PYTHONPATH": ROOT},
                        timeout=240)
    assert single.returncode == 75 and f"chief:0 resumes at step {first} " in single.output, single.output[-3000:]
    second = _saved_step(single.output)
    assert first < second, (first, second)
    assert set(finished_backups(model_dir)) == {"chief-0"}  # The workers' older states went once it backed up.
    code, text = _launch(f"--model_dir={model_dir}")
    assert code == 0, text[-3000:]
    for task in ("worker:0", "worker:1"):
        assert re.search(rf"{task} resumes at step {second} .*chief-0 \(a task this layout does not have\)", text), (
            text[-3000:])
    difference = weights_difference(
        checkpoint_arrays(model_dir / "checkpoints" / "epoch003.weights.h5"),
        checkpoint_arrays(pytest.uninterrupted_dir / "checkpoints" / "epoch003.weights.h5"))
    print(f"2 workers preempted at step {first}, 1 process at {second}, 2 workers again: resumed at {second}; "
          f"weights {difference:.2g} (relative L2) from the uninterrupted run")
    assert difference <= 1e-10  # The layout test's float64 bound (tests/test_train.py, LAYOUT_CASES).
    assert finished_backups(model_dir) == {"worker-0": [(STEPS, True)], "worker-1": [(STEPS, True)]}


def test_a_grow_onto_an_empty_disk_waits_for_a_holder_slow_to_load(tmp_path):
    """Issue 42 item 5: the worker with an empty disk reached the state's all-reduce at once
    while worker:0 still loaded its backup; with a collective timeout shorter than the load,
    the grow failed on every restart. worker:0's load takes 6 s here, the timeout is 3 s."""
    script = os.path.join(ROOT, "tests", "workers", "slow_holder.py")
    first = run_cluster([script, tmp_path, 1], spec=local_spec(2), env={"PYTHONPATH": ROOT}, timeout=180)
    assert [r.returncode for r in first] == [0, 0], [r.output[-2000:] for r in first]
    shutil.rmtree(tmp_path / "worker-1")  # Its disk replaced by an empty one.
    grown = run_cluster([script, tmp_path, 2, "--load_seconds=6"], spec=local_spec(2), env={"PYTHONPATH": ROOT},
                        timeout=180)
    assert [r.returncode for r in grown] == [0, 0], [r.output[-2000:] for r in grown]
    assert "worker:1 resumes at step 8 (epoch 2, step 0 of it) from a peer" in grown[1].output, grown[1].output[-2000:]
    assert len({w for r in grown for w in _fingerprints(r.output).values()}) == 1


def test_periodic_sync_preempted_between_averages_resumes_to_the_uninterrupted_weights(tmp_path):
    """Issue 42 item 6: under `sync="every:N"` the workers' weights differ between averages. A
    restart averaged them at its start (and again at the resumed partial epoch's end), and the
    last backup came before the final average: the run ended elsewhere than the uninterrupted
    one. Preempted at step 10 (backed up at 11, between the averages of steps 8 and 12)."""
    sync = "--sync=every:4"
    code, text = _launch(f"--model_dir={tmp_path / 'uninterrupted'}", sync)
    assert code == 0, text[-3000:]
    reference = _fingerprints(text)
    assert len(set(reference.values())) == 1, reference  # The final average, on both.
    code, text = _launch(f"--model_dir={tmp_path / 'run'}", sync, "--sigterm_at_step=10")
    assert code == 75, text[-3000:]
    saved = _saved_step(text)
    assert saved % 4, saved  # Between two averages: each worker's own weights.
    code, text = _launch(f"--model_dir={tmp_path / 'run'}", sync)
    assert code == 0, text[-3000:]
    assert re.search(rf"worker:\d resumes at step {saved} ", text) and "not the uninterrupted" not in text, text[-3000:]
    assert _fingerprints(text) == reference, (_fingerprints(text), reference)  # Bit-identical, every worker.


SLOW_WRITES = os.path.join(ROOT, "tests", "workers", "slow_writes.py")


def _in_flight(text, task):
    """The steps whose weights `task` began writing in the background and never finished."""
    started = re.findall(rf"\[{task}\] write of step (\d+) started", text)
    done = set(re.findall(rf"\[{task}\] write of step (\d+) done", text))
    return [int(s) for s in started if s not in done]


@pytest.mark.slow  # 45 s: make soak. make test SIGTERMs one (below).
def test_a_worker_killed_while_its_backup_is_written_resumes_from_the_newest_whole_one(tmp_path, uninterrupted):
    """Issue 43: worker:1 SIGKILLed at step 12, its backup of step 10 still being written in
    the background (each write takes 2 s more here): the restart resumes at the newest backup
    whole on a disk and ends on the uninterrupted run's weights, bit for bit."""
    code, text = _launch(f"--model_dir={tmp_path / 'run'}", "--kill_at_step=12", f"--kill_marker={tmp_path / 'k'}",
                         extra=["--max_restarts=1", "--grace_period=10"], script=SLOW_WRITES)
    assert code == 0, text[-3000:]
    assert "worker:1 was killed by SIGKILL" in text and 10 in _in_flight(text.split("restart")[0], "worker:1"), (
        text[-4000:])
    resumed = {int(s) for s in re.findall(r"worker:\d resumes at step (\d+)", text)}
    assert len(resumed) == 1 and resumed.pop() in (5, 10), text[-3000:]  # 10 if worker:0's own write ended.
    assert set(_fingerprints(text).values()) == {uninterrupted}, text[-3000:]


def test_sigterm_while_a_backup_is_written_saves_one_step_and_resumes_exactly(tmp_path, uninterrupted):
    """Issue 43: SIGTERM to worker:1 at step 11, the backup of step 10 still being written in the
    background: every worker agrees on step 12, writes it once 10 is whole, and exits 75; the
    restart resumes there and ends on the uninterrupted run's weights, bit for bit."""
    code, text = _launch(f"--model_dir={tmp_path / 'run'}", "--sigterm_at_step=11", script=SLOW_WRITES)
    assert code == 75, text[-3000:]
    saved = {int(s) for s in re.findall(r"preempted: backed up step (\d+) like every worker", text)}
    assert len(saved) == 1 and 11 <= min(saved) <= 13, text[-3000:]
    assert re.search(r"write of step 10 started(.|\n)*preempted", text), text[-3000:]  # In flight at the SIGTERM.
    code, text = _launch(f"--model_dir={tmp_path / 'run'}")
    assert code == 0 and re.search(rf"worker:\d resumes at step {min(saved)} ", text), text[-3000:]
    assert set(_fingerprints(text).values()) == {uninterrupted}, text[-3000:]


def _run_on(workers, model_dir, *args):
    """my_script on `workers` processes (the launcher; one process alone: no TF_CONFIG)."""
    script = [sys.executable, SCRIPT, f"--model_dir={model_dir}", *map(str, args)]
    if workers == 1:
        result = run_single(script[1:], env={"PYTHONPATH": ROOT}, timeout=300)
        return result.returncode, result.output
    done = subprocess.run([sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}", "--", *script],
                          env=ENV, capture_output=True, text=True, timeout=400)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow  # 1 to 3 min each: make soak. make test plays 2 -> 1 -> 2 (above).
@pytest.mark.parametrize("layouts", [(1, 2, 1), (3, 2, 3), (4, 2)])
def test_any_sequence_of_layouts_resumes_at_the_newest_step_and_ends_on_the_uninterrupted_weights(tmp_path,
                                                                                                   layouts):
    """Issue 42: preempted on each layout but the last, at later and later steps, on one shared
    disk; each start resumes at the step the one before saved (the newest), never at an older
    one; the end is the uninterrupted 2-worker run's within the float64 layout bound; 4 -> 2
    then run again trains nothing. A global batch of 48: 11 steps an epoch on 1 to 4 workers (the
    last of 32 rows, split 8 a worker on 4, 16 on 2)."""
    batch = "--global_batch_size=48"
    code, text = _run_on(2, tmp_path / "uninterrupted", batch)
    assert code == 0, text[-3000:]
    model_dir, saved = tmp_path / "run", None
    for index, workers in enumerate(layouts):
        last = index == len(layouts) - 1
        fault = [] if last else [f"--sigterm_at_step={6 + 9 * index}",
                                 f"--sigterm_task={'chief:0' if workers == 1 else 'worker:0'}"]
        code, text = _run_on(workers, model_dir, batch, *fault)
        assert code == (0 if last else 75), (layouts, index, text[-3000:])
        if saved is not None:
            resumed = {int(s) for s in re.findall(r"(?:chief|worker):\d resumes at step (\d+)", text)}
            assert resumed == {saved}, (layouts, index, saved, text[-3000:])  # The newest, on every worker.
        if not last:
            saved = _saved_step(text)
    final = [checkpoint_arrays(folder / "checkpoints" / "epoch003.weights.h5")
             for folder in (model_dir, tmp_path / "uninterrupted")]
    difference = weights_difference(*final)
    print(f"{' -> '.join(map(str, layouts))}: weights {difference:.2g} (relative L2) from the uninterrupted run")
    assert difference <= 1e-10  # The layout test's float64 bound (tests/test_train.py, LAYOUT_CASES).
    tasks = {f"worker-{i}" for i in range(layouts[-1])} if layouts[-1] > 1 else {"chief-0"}
    assert set(finished_backups(model_dir)) == tasks  # The other layouts' backups retired.
    if layouts == (4, 2):
        code, text = _run_on(2, model_dir, batch)
        assert code == 0 and text.count("finished at step 33 before") == 2 and "resumes at" not in text, text[-3000:]
