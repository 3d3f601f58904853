"""Keras 3 fit/evaluate/predict under two real workers, against one process."""

import concurrent.futures
import glob
import json
import math
import os
import re

import numpy as np
import pytest

from cluster_runner import check_ok
from cluster_runner import local_spec
from cluster_runner import run_cluster
from cluster_runner import run_script
from cluster_runner import run_single

HERE = os.path.dirname(__file__)
USER_SCRIPT = os.path.join(HERE, "workers", "keras_user.py")
COMPILE_SCRIPT = os.path.join(HERE, "workers", "compile_checks.py")
ENV = {"PYTHONPATH": os.path.dirname(HERE)}
# As root, worker:1 sees the chief's `shared/` read-only (a mount namespace of its own), as
# a host whose disk those files are not on: a write by it fails where Keras makes it.
READ_ONLY = ["--read_only_shared"] if os.geteuid() == 0 else []

pytestmark = pytest.mark.multiworker


def _load(out, task):
    with open(os.path.join(out, f"{task}.json")) as f:
        record = json.load(f)
    weights = np.load(os.path.join(out, f"{task}.npz"))
    record["weights"] = [weights[k] for k in sorted(weights, key=lambda k: int(k.split("_")[1]))]
    return record


def check_two_worker_run(out, results):
    """Asserts what a correct 2-worker run wrote; returns the chief's record."""
    check_ok(results)
    chief, other = _load(out, "worker_0"), _load(out, "worker_1")
    assert chief["pid"] != other["pid"]
    for task in ("worker_0", "worker_1"):  # Keras's SUM branch, 1 + 2 over two workers.
        with open(os.path.join(out, f"{task}_sum.json")) as f:
            assert json.load(f) == 3.0
    assert chief["replicas"] == other["replicas"] == 2
    for a, b in zip(chief["weights"], other["weights"]):
        np.testing.assert_array_equal(a, b)
    assert chief["history"] == other["history"]
    assert chief["predict"] == other["predict"]
    # Only the chief writes into the shared directories.
    assert chief["saved"] and not other["saved"], (chief["saved"], other["saved"])
    events = glob.glob(os.path.join(out, "shared", "logs", "**", "events.out.*"), recursive=True)
    assert events and chief["tensorboard_dir"] == os.path.join(out, "shared", "logs")
    assert not other["tensorboard_dir"].startswith(os.path.join(out, "shared")), (other["tensorboard_dir"], events)
    return chief


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = run_single([USER_SCRIPT, "--out", out], env=ENV)
    check_ok([result])
    return _load(out, "single")


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_workers")
    # fit inside strategy.scope(), as many Keras scripts have it (it hung there: fix 11).
    results = run_cluster([USER_SCRIPT, "--out", out, *READ_ONLY, "--fit_in_scope"], spec=local_spec(2), env=ENV)
    return out, results


def test_two_workers_match_one_process(two_workers, reference):
    chief = check_two_worker_run(*two_workers)
    for a, b in zip(chief["weights"], reference["weights"]):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name, values in reference["history"].items():
        np.testing.assert_allclose(chief["history"][name], values, rtol=1e-4)
    for name, value in reference["evaluate"].items():
        np.testing.assert_allclose(chief["evaluate"][name], value, rtol=1e-4)
    # predict: 10 rows in batches of 4 (the last one split unevenly), each row once, in order.
    assert len(chief["predict"]) == 10
    np.testing.assert_allclose(chief["predict"], reference["predict"], rtol=1e-4, atol=1e-6)


def test_validation_iterators_are_released_off_the_main_thread(two_workers, tmp_path):
    """Keras drops each epoch's validation iterator in the next, and the last when `fit`
    returns; fix 8 does it on a thread.

    Under tf.distribute the drop waits for tf.data's autotuning thread (up to about 4 s an
    epoch in `make bench`'s P1); the time depends on how long that thread sleeps, so the
    test checks where the drop happens: with the fix on its own thread, without on the
    main thread that runs `fit`.
    """
    out, results = two_workers
    check_ok(results)
    for task in ("worker_0", "worker_1"):  # Epochs 2 and 3 let go of the one before, fit's end of the last.
        released = _load(out, task)["validation_iterators_released_by"]
        assert released == ["distrib_tf-iterator-release"] * 3, released
    without = run_single([USER_SCRIPT, "--out", tmp_path, "--without_fix", "iterator_release"], env=ENV)
    check_ok([without])
    assert _load(tmp_path, "single")["validation_iterators_released_by"][:2] == ["MainThread"] * 2


def test_checkpoints_hold_the_chiefs_files_only(two_workers):
    out, results = two_workers
    check_two_worker_run(out, results)
    files = sorted(os.listdir(os.path.join(out, "shared", "checkpoints")))
    assert files == ["epoch1.weights.h5", "epoch2.weights.h5", "epoch3.weights.h5"]
    assert sorted(os.listdir(os.path.join(out, "shared", "backup"))) == [
        "latest.weights.h5", "training_metadata.json"]


@pytest.mark.slow  # 24 to 29 s: make soak (the launcher's kill-and-resume tests run in make test).
def test_killed_run_resumes_from_backup(tmp_path, two_workers):
    first = run_cluster(
        [USER_SCRIPT, "--out", tmp_path, "--kill_self_at_epoch", 2],
        spec=local_spec(2), env=ENV, timeout=120,
    )
    assert first[1].returncode == -9 and first[0].returncode != 0, [r.returncode for r in first]
    with open(tmp_path / "shared" / "backup" / "training_metadata.json") as f:
        assert json.load(f)["epoch"] == 2
    second = run_cluster([USER_SCRIPT, "--out", tmp_path], spec=local_spec(2), env=ENV)
    resumed = check_two_worker_run(tmp_path, second)
    assert resumed["epochs_run"] == [2]
    uninterrupted = _load(two_workers[0], "worker_0")
    for a, b in zip(resumed["weights"], uninterrupted["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# Keras makes the directory (os.makedirs: on a read-only view, EROFS, or EEXIST once the
# chief made it) or, when it exists, h5py opens the file for writing.
READ_ONLY_WRITE = (r"Error: \[Errno (30\] Read-only file system|17\] File exists): '\S*/shared/{0}'|"
                   r"name = '\S*/shared/{0}/[^']*', errno = 30, error message = 'Read-only file system'")
# The chief's coordination service on worker:1's death, in TensorFlow 2.19's to 2.21's words, then 2.18's.
DEAD_PEER = (r"The following tasks are unhealthy \(stopped sending heartbeats\):\n/job:worker/replica:0/task:1"
             r"|Task /job:worker/replica:0/task:1 heartbeat timeout\. This indicates that the remote task has failed")


# worker:1 traces the train step 14 s longer than worker:0, and the chief ends fit 14 s
# after worker:1; a collective times out after 10 s. Not less: a function's first run after
# tracing (and the first eager collectives that read the metrics) took over 6 s on 2 busy
# cores, in 2 runs of 3 under `make test-compat`.
SLOW_TRACE = ["--collective_timeout", 10, "--slow_trace_seconds", 14]
SLOW_END = ["--collective_timeout", 10, "--slow_train_end_seconds", 14]


@pytest.mark.parametrize("fix, flags, failures", [
    ("symbolic_build", [], {"worker:0": r"Attempt to convert a value \(PerReplica"}),
    ("reduce_per_replica", [], {"worker:0": r"Invalid reduction dimension 0 for input with 0 dimensions",
                                "worker:1": r"Invalid reduction dimension 0 for input with 0 dimensions"}),
    ("model_checkpoint", READ_ONLY,
     {"worker:1": READ_ONLY_WRITE.format("checkpoints"),
      "worker:0": DEAD_PEER}),
    # make soak: the next three, whose upstream failure is model_checkpoint's above (a write on the
    # read-only view in Keras's saving, then the chief's dead-peer error); make test-tf leaves them too.
    pytest.param("backup_and_restore", READ_ONLY,
                 {"worker:1": READ_ONLY_WRITE.format("backup"),
                  "worker:0": DEAD_PEER}, marks=pytest.mark.slow),
    pytest.param("backup_and_restore_end", [*READ_ONLY, "--delete_backup"],
                 {"worker:1": r"OSError: \[Errno 30\] Read-only file system: "
                              r"'(latest\.weights\.h5|training_metadata\.json)'"}, marks=pytest.mark.slow),
    pytest.param("tensorboard", READ_ONLY,
                 {"worker:1": r"PermissionDeniedError: \{\{function_node __wrapped__CreateSummaryFileWriter\S*\}\} "
                              r"\S*/shared/logs\S*; Read-only file system",
                  "worker:0": DEAD_PEER}, marks=pytest.mark.slow),
    ("trace_then_meet", SLOW_TRACE,
     {"worker:0": r"DeadlineExceededError[\s\S]*Collective has timed out during execution"}),
    # worker:1 at evaluate's reset_metrics: its collective times out; once in five runs TensorFlow's
    # runtime aborted there instead, cancelling the timed-out collective (seen in make test).
    ("meet_before_reset", SLOW_END,
     {"worker:1": r"DeadlineExceededError[\s\S]*Collective has timed out during execution|"
                  r"Mutex corrupt: waiting writer with no waiters"}),
    # The chief's first save (ModelCheckpoint's) inside strategy.scope(): it waits in the broadcast
    # of a reference Optimizer's variable, which no other worker joins (the stack it is dumped with).
    ("saving_outside_scope", ["--fit_in_scope", "--hang_seconds", 30],  # Waiting from ~12 s in.
     {"worker:0": r"collective_bcast_send[\s\S]*in __init__[\s\S]*in get_attr_skipset"}),
])
def test_each_fix_is_needed(tmp_path, fix, flags, failures):
    """Without the fix, the upstream failure itself, in the output of the task it hits."""
    if fix not in ("symbolic_build", "reduce_per_replica", "saving_outside_scope") and not READ_ONLY:
        pytest.skip("needs root: worker:1 sees the chief's files read-only through a mount namespace")
    results = run_cluster([USER_SCRIPT, "--out", tmp_path, "--epochs", 1, "--without_fix", fix, *flags],
                          spec=local_spec(2), env=ENV, timeout=90)
    outputs = {result.task: result.output for result in results}
    for task, failure in failures.items():
        assert re.search(failure, outputs[task]), (task, outputs[task][-3000:])
    if fix == "reduce_per_replica":  # The SUM branch: `strategy.reduce("SUM", v)` without its axis.
        for task in ("worker_0", "worker_1"):
            with open(tmp_path / f"{task}_sum.json") as f:
                assert json.load(f) == "TypeError: StrategyBase.reduce() missing 1 required positional argument: 'axis'"


ACCUMULATION_SCRIPT = os.path.join(HERE, "workers", "grad_accumulation.py")
MERGE_CALL_IN_COND = r"`merge_call` called while defining a new graph or a tf\.function"


def test_gradient_accumulation_trains_as_plain_keras_on_one_device_and_counts_batches(tmp_path):
    """Fix 12, in one process on 2 logical CPU replicas (its code is MultiWorkerMirrored's too).
    Without it, plain Keras under MirroredStrategy fails at the first step with Keras's
    `merge_call` inside its own `cond`. With it, `gradient_accumulation_steps=4` (AdamW,
    weight decay, global clipnorm) through `distrib_tf.Run` trains as plain Keras on one
    device: in float64 the only difference in the arithmetic is each step's gradient summed
    from two replicas' halves instead of over the 8 rows at once, a rounding of 1e-16 relative
    over 12 steps (1e-12 leaves margin; they came out bit for bit here). The run counts
    batches, not `iterations` (one per 4 batches): backups every 4 steps are of steps 4 and 8
    (and 5, 11: the states before each epoch's last execution), and a second process resumes
    at step 6, inside an accumulation, with the accumulators' state."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "TF_CPP_MIN_LOG_LEVEL": "3"}
    code, output, first = run_script(ACCUMULATION_SCRIPT, tmp_path, env=env)
    assert code == 0 and first, output[-3000:]
    assert re.search(MERGE_CALL_IN_COND, first["without_fix"]), first["without_fix"]
    assert first["run"]["backups_at_epoch_ends"] == [[4, 5]] and first["run"]["step"] == 6, first["run"]
    code, output, second = run_script(ACCUMULATION_SCRIPT, tmp_path, "--epochs=2", env=env)
    assert code == 0 and second, output[-3000:]
    assert "chief:0 resumes at step 6 (epoch 2, step 0 of it)" in output, output[-3000:]
    assert "did not count this step" not in output
    run, plain = second["run"], first["plain"]
    assert run["backups_at_epoch_ends"] == [[8, 11]] and run["step"] == 12 and run["resumed_at_step"] == 6, run
    assert run["iterations"] == plain["iterations"] == 3  # Keras's own count: 12 batches over 4.
    np.testing.assert_allclose(run["weights"], plain["weights"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(run["history"]["loss"], plain["history"]["loss"], rtol=1e-12)


@pytest.mark.slow  # make soak, and make test-compat under the other Keras minors.
def test_a_worker_slow_to_trace_or_to_save_is_waited_for_not_timed_out(tmp_path):
    """Each step function is traced on every worker, then they meet, then its collectives
    run; they meet again before the metrics reset that starts an evaluate: the collective
    timeout measures only a dead peer (the fixes' cases above fail)."""
    results = run_cluster([USER_SCRIPT, "--out", tmp_path, "--epochs", 1, *SLOW_TRACE,
                           "--slow_train_end_seconds", 14],
                          spec=local_spec(2), env=ENV, timeout=120)
    check_ok(results)
    weights = [np.load(tmp_path / f"{task}.npz") for task in ("worker_0", "worker_1")]
    for name in weights[0].files:  # From separate processes: one synchronous model.
        np.testing.assert_array_equal(weights[0][name], weights[1][name])


LOSS_SCALE_SCRIPT = os.path.join(os.path.dirname(__file__), "workers", "loss_scale.py")


@pytest.mark.slow  # make soak, and make test-compat under the other Keras minors.
def test_an_overflow_on_one_worker_skips_the_step_on_every_worker(tmp_path):
    """mixed_float16, an Inf in worker:1's batch of step 3 only: every worker skips that
    step, halves its loss scale and counts the step; the weights stay identical."""
    check_ok(run_cluster([LOSS_SCALE_SCRIPT, tmp_path], spec=local_spec(2), env=ENV, timeout=120))
    runs = [_load(tmp_path, task) for task in ("worker_0", "worker_1")]
    for run in runs:
        assert math.isnan(run["loss"][0])  # The overflow happened: the epoch's mean holds it.
        assert run["scale"] == run["start_scale"] / 2, run  # Skipped once, on both.
        assert run["iterations"] == run["steps"], run  # Every batch counted, the skipped one too.
    weights = [np.load(tmp_path / f"{task}.npz") for task in ("worker_0", "worker_1")]
    for name in weights[0].files:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    # Without the fix each replica takes its own branch of Keras's `cond`, and their collectives
    # no longer pair up: each worker waits for the other's until the timeout or, seen in 1 run
    # of 3, TensorFlow's collective executor crashes with SIGSEGV on the mismatch.
    results = run_cluster([LOSS_SCALE_SCRIPT, tmp_path / "without", "--without_fix=loss_scale",
                           "--collective_timeout=10"], spec=local_spec(2), env=ENV, timeout=120)
    for result in results:  # Its peer gone first, a worker reports it lost or unhealthy.
        ended = re.search(r"DeadlineExceededError[\s\S]*Collective has timed out during execution|"
                          r"UnavailableError|tasks are unhealthy", result.output)
        assert result.returncode != 0 and (ended or result.returncode < 0), (
            result.task, result.returncode, result.output[-3000:])
    assert any(re.search(r"Collective has timed out", r.output) or r.returncode < 0 for r in results)


SPARSE_SCRIPT = os.path.join(os.path.dirname(__file__), "workers", "sparse_grads.py")


def test_an_embeddings_gradient_stays_sparse_and_sums_its_duplicate_rows(tmp_path):
    """A 250k-row embedding under Adagrad, in float64 so that only a different sum shows:
    on 2 workers only the rows looked up cross the network and the optimizer updates the
    table sparsely (Keras's own `test_fit_sparse` check); the weights are those of the
    dense gradient in one process, to float64 rounding; without the fix they are not."""
    flags = ["--optimizer=adagrad", "--float64"]
    check_ok(run_cluster([SPARSE_SCRIPT, tmp_path / "sparse", *flags], spec=local_spec(2), env=ENV))
    check_ok([run_single([SPARSE_SCRIPT, tmp_path / "dense", *flags, "--dense"], env=ENV)])
    check_ok([run_single([SPARSE_SCRIPT, tmp_path / "without", *flags, "--without_fix=sum_duplicate_rows"],
                         env=ENV)])
    runs = {task: _load(tmp_path / "sparse", task) for task in ("worker_0", "worker_1")}
    for run in runs.values():
        assert "sequential/embedding/embeddings:0" in run["sparse_updates"], run["sparse_updates"]
        assert run["allreduce_bytes"] < run["table_bytes"] / 100, run  # Measured: 33,928 of 32,000,000.
    for a, b in zip(runs["worker_0"]["weights"], runs["worker_1"]["weights"]):
        np.testing.assert_array_equal(a, b)
    dense = _load(tmp_path / "dense", "single")
    assert dense["sparse_updates"] == [] and dense["allreduce_bytes"] >= dense["table_bytes"]
    without = _load(tmp_path / "without", "single")
    embedding = 0  # The first weight; Adagrad squares each duplicate row without the fix.
    # float64 sums of at most 512 rows in another order: under 1e-13 of weights near 0.05.
    np.testing.assert_allclose(runs["worker_0"]["weights"][embedding], dense["weights"][embedding],
                               rtol=0, atol=1e-12)
    assert np.max(np.abs(without["weights"][embedding] - dense["weights"][embedding])) > 1e-6


def test_compile_refuses_what_cannot_run_on_replicas():
    result = run_single([COMPILE_SCRIPT], env=ENV)
    check_ok([result])
    outcomes = json.loads(result.output.strip().splitlines()[-1])
    assert "Expected 1" in outcomes["steps_per_execution"]["with_fix"]
    assert "Expected False or 'auto'" in outcomes["jit_compile"]["with_fix"]
    # Without the check, both fail later and less clearly, inside fit().
    assert outcomes["steps_per_execution"]["without_fix"].startswith("InvalidArgumentError")
    assert outcomes["jit_compile"]["without_fix"].startswith("InvalidArgumentError")


SHAPES_SCRIPT = os.path.join(HERE, "workers", "keras_io_shapes.py")


def test_keras_io_timeseries_and_dcgan_shapes_train_as_one_process(tmp_path):
    """keras.io's weather forecast (a window length `timeseries_dataset_from_array` leaves
    unknown; fix 1 built it as 1: "expected shape=(None, 12, 3), found shape=(1, 1, 3)") and
    its DCGAN (no `call`, two optimizers of its own) train under a run on 2 replicas in one
    process: the same iterations and, in float64, the same weights and History as plain Keras
    in one process, to rounding. Keras's own `fit` on those replicas fails on the GAN: without
    fix 1 at its build, without fix 12 when its optimizers are built inside the step."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda flags: run_single([SHAPES_SCRIPT, tmp_path / flags[0], *flags[1:]], env=ENV),
                             [("plain",), ("run", "--replicas", 2)]))
    check_ok(runs)
    plain, run = (json.loads((tmp_path / name / "result.json").read_text()) for name in ("plain", "run"))
    assert plain["timeseries"]["iterations"] == run["timeseries"]["iterations"] == [24]
    assert plain["gan"]["iterations"] == run["gan"]["iterations"] == [8, 8]  # Each optimizer, each step.
    for shape in ("timeseries", "gan"):
        assert len(run[shape]["weights"]) == len(plain[shape]["weights"])
        for a, b in zip(run[shape]["weights"], plain[shape]["weights"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    np.testing.assert_allclose(run["timeseries"]["history"]["loss"], plain["timeseries"]["history"]["loss"],
                               rtol=1e-12)
    for name in ("d_loss", "g_loss"):  # Keras scales a loss object's mean by 1/replicas under a strategy
        # (scale_loss_for_distribution), and the GAN's own Mean metrics average those scaled values.
        np.testing.assert_allclose(np.multiply(run["gan"]["history"][name], 2), plain["gan"]["history"][name],
                                   rtol=1e-12)
    assert run["without"]["symbolic_build"].startswith("RuntimeError: Unable to automatically build the model")
    assert re.match(r"InvalidArgumentError[\s\S]*You must feed a value for placeholder tensor",
                    run["without"]["build_across_replicas"]), run["without"]["build_across_replicas"][-3000:]
