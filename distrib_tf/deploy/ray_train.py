"""The main job, or a user's Keras 3 `fit`, under Ray Train (`pip install distrib-tf[ray]`).

Ray Train's `TensorflowTrainer` starts one Ray worker per rank, gives each a `TF_CONFIG`,
and restarts the whole worker group when one fails. Two things here:

- `main_job_loop`, the `train_loop_per_worker` of the main job: each Ray worker runs its
  task of `python -m distrib_tf.train` as a child process, so every guarantee of the
  main job holds as under our launcher (its own backups, agreed on resume; SIGTERM backs
  up and exits 75). The child's epoch events become one `ray.train.report` per epoch on
  every rank (a barrier in Ray, which every rank reaches alike); when it ends, rank 0
  reports the chief's trained model (`model.keras`, `summary.json`) as the run's
  `Checkpoint`. A child that exits non-zero raises `JobExit` with its code.
- `trainer(loop, ...)`: a `TensorflowTrainer` whose failure policy reads our exit codes:
  2 (bad input) and 65 (NaN stop) fail the run at once, since a retry fails again; 75
  (preempted, backed up) counts against `FailureConfig.max_preemption_failures`, as Ray's
  own node preemptions do; anything else against `max_failures`. A restart resumes from
  the workers' backups, not from Ray's checkpoint. A user's own loop (`fit` under
  `distrib_tf.make_strategy()`) goes through it too.

Ray sets `TF_USE_LEGACY_KERAS=1` in its TensorFlow workers, which turns `tf.keras` into
tf_keras (an import error where tf_keras is not installed) in them and in every child;
`main_job_loop` drops it from the child's environment and `distrib_tf.make_strategy()`
from its own process. Backups live under `--model_dir` on each worker's node; Ray gives
ranks afresh on a restart, so the tasks are numbered in the order of their nodes'
addresses (`node_ordered`) and come back to the disk where their backups are. With nodes
that change, give `--model_dir` on a disk every node sees.

Start the main job, or a user's script on `distrib_tf.Run`, on the Ray cluster at `--address`:

    distrib-tf-ray --num_workers=2 -- --model=cnn --model_dir=/tmp/runs/cnn
    distrib-tf-ray --num_workers=2 --script=my_script.py -- --model_dir=/tmp/runs/mine

No TensorFlow in this module: the job runs in the child.
"""

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from distrib_tf import argparsing
from distrib_tf import events
from distrib_tf import exit_codes
from distrib_tf import lifeline
from distrib_tf.cluster import split_address

LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
PERMANENT = (exit_codes.USAGE, exit_codes.PRUNED, exit_codes.NONFINITE)  # A retry ends the same way.
CHECKPOINT_FILES = ("model.keras", "summary.json")


class JobExit(RuntimeError):
    """The main job's task on this Ray worker ended with a non-zero exit code."""

    def __init__(self, code: int, rank: int):
        self.code, self.rank = code, rank
        super().__init__(f"rank {rank}: the main job's task exited {code}")

    def __reduce__(self):  # Ray pickles it to the controller.
        return JobExit, (self.code, self.rank)


def main_job_loop(config: dict) -> None:
    """Ray Train's `train_loop_per_worker` for `python -m distrib_tf.train *config["argv"]`, or
    for a user's script on `distrib_tf.Run` (`python config["script"] *config["argv"]`), whose
    events, exit codes and chief outputs are the main job's."""
    import ray.train  # pylint: disable=import-outside-toplevel

    context = ray.train.get_context()
    rank = context.get_world_rank()
    read_end, write_end = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != LEGACY_KERAS_ENV}
    env["TF_CONFIG"] = json.dumps(node_ordered(json.loads(os.environ["TF_CONFIG"])))
    env[events.FD_ENV] = events.pipe_name(write_end)
    env[lifeline.PARENT_ENV] = str(os.getpid())  # The child gets SIGTERM if this Ray worker dies.
    program = [config["script"]] if config.get("script") else ["-m", "distrib_tf.train"]
    task = f"worker:{json.loads(env['TF_CONFIG'])['task']['index']}"
    # A sweep's trial: every rank appends its task's events to a file the sweep reads.
    sink = open(config["events"], "a", encoding="utf-8") if config.get("events") else None  # pylint: disable=consider-using-with
    child = subprocess.Popen([sys.executable, *program, *config["argv"]], env=env,
                             pass_fds=(write_end,), start_new_session=True)
    os.close(write_end)
    finished = None
    try:
        with os.fdopen(read_end) as stream:
            for line in stream:
                event = events.parse(line)
                if event is None:
                    continue
                if sink:
                    sink.write(json.dumps({**event, "task": task}, default=str) + "\n")
                    sink.flush()
                if event["event"] == "epoch":
                    ray.train.report({"epoch": event["epoch"], **event["metrics"]})
                elif event["event"] == "finished":
                    finished = event
        code = child.wait()
    finally:
        _stop(child)
        if sink:
            sink.close()
    if code != exit_codes.OK:
        raise JobExit(code, rank)
    if finished is None:
        raise RuntimeError(f"rank {rank}: the main job exited 0 without its `finished` event")
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if finished.get("summary"):  # The chief's.
            model_dir = os.path.dirname(finished["summary"])
            for name in CHECKPOINT_FILES:  # A user's script may save no model.
                if os.path.exists(os.path.join(model_dir, name)):
                    shutil.copy(os.path.join(model_dir, name), directory)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report({"final": True, **(finished.get("final") or {})}, checkpoint=checkpoint)


def node_ordered(tf_config: dict) -> dict:
    """Ray's `TF_CONFIG` with the workers in the order of their nodes' addresses. Pure.

    Ray gives ranks afresh to the workers of each restarted group: seen here, the two
    ranks of a two-node run swapped nodes after one was killed, and each found on its
    node no backup of its task, so the job started again from step 0. In node order a task
    comes back to the node (and the disk) where its backups are; tasks of one node may
    swap among themselves, which is harmless: their backups are on that same disk, and
    the workers of a synchronous job back up the same state.

    Example:

        >>> node_ordered({"cluster": {"worker": ["10.0.0.10:5000", "10.0.0.9:4000"]},
        ...               "task": {"type": "worker", "index": 0}})["task"]
        {'type': 'worker', 'index': 1}
    """
    workers = tf_config["cluster"]["worker"]
    own = workers[tf_config["task"]["index"]]

    def node_then_port(address):
        host, port = split_address(address)
        try:
            return (0, int(ipaddress.ip_address(host)), port)
        except ValueError:  # A hostname.
            return (1, host, port)

    ordered = sorted(workers, key=node_then_port)
    return {**tf_config, "cluster": {**tf_config["cluster"], "worker": ordered},
            "task": {"type": "worker", "index": ordered.index(own)}}


CHILD_GRACE_SECONDS = 60.0  # From SIGTERM to SIGKILL of a child this worker stops.


def _stop(child: subprocess.Popen) -> None:
    """Ray is stopping this worker (or the loop failed): SIGTERM the child's whole process
    group (the job backs up and exits 75), SIGKILL what is left after the grace, never wait
    forever. A child still running would write the same `backup/<task>` as the new group's;
    the backups' lock (`distrib_tf.keras.resume.hold`) keeps the two apart meanwhile."""
    if child.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, CHILD_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def exit_code_of(error) -> int | None:
    """The main job's exit code inside a Ray worker failure, or None when it is not one."""
    while error is not None:
        if isinstance(error, JobExit):
            return error.code
        # Ray wraps what a train function raised (`UserExceptionWithTraceback._base_exc`).
        error = getattr(error, "_base_exc", None) or getattr(error, "cause", None) or error.__cause__
    return None


def _failure_policy(failure_config):
    """Ray's default policy, with our exit codes read (see the module docstring)."""
    # pylint: disable=import-outside-toplevel
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    class ExitCodePolicy(DefaultFailurePolicy):
        def make_decision(self, training_failed_error):
            if not isinstance(training_failed_error, WorkerGroupError):
                return super().make_decision(training_failed_error)
            codes = {exit_code_of(e) for e in training_failed_error.worker_failures.values()}
            if permanent := codes & set(PERMANENT):
                print(f"distrib_tf: a rank exited {min(permanent)}: not retried", file=sys.stderr)
                return FailureDecision.RAISE
            if codes == {exit_codes.PREEMPTED}:
                self._preemption_failures += 1
                limit = self.failure_config.max_preemption_failures
                if limit != -1 and self._preemption_failures > limit:
                    return FailureDecision.RAISE
                print(f"distrib_tf: every failed rank exited 75 (preempted): restart "
                      f"{self._preemption_failures}, not a failure", file=sys.stderr)
                return FailureDecision.RETRY
            return super().make_decision(training_failed_error)

    return ExitCodePolicy(failure_config)


def parse_num_workers(text: str) -> int | tuple[int, int]:
    """`"2"` -> 2; `"1:4"` -> (1, 4), Ray Train's elastic range. Pure.

    Raises:
        ValueError: not `N` or `MIN:MAX` with 1 <= MIN <= MAX.
    """
    low, colon, high = text.partition(":")
    if low.isdigit() and (high.isdigit() if colon else True):
        low_n, high_n = int(low), int(high or low)
        if 1 <= low_n <= high_n:
            return (low_n, high_n) if colon else low_n
    raise ValueError(f"Invalid value for `--num_workers`. Received: {text!r}. Expected N, or MIN:MAX (Ray Train's "
                     "elastic range) with 1 <= MIN <= MAX.")


def trainer(loop, *, num_workers: int | tuple[int, int], config: dict | None = None, storage_path: str,
            name: str = "distrib_tf", max_failures: int = 3, cpus_per_worker: float = 1):
    """A Ray `TensorflowTrainer` running `loop` on `num_workers` ranks, restarted up to
    `max_failures` times on a failure (preemptions apart) under our exit-code policy.

    `num_workers=(MIN, MAX)`: Ray Train's elastic group, which restarts with the workers it
    can have (a node lost: fewer; one back: more, checked every minute). Each restart
    resumes from the workers' backups on any number of workers (`distrib_tf.keras.backup`):
    a task with none gets the state from one that has it, a layout without the tasks that
    wrote them reads theirs where its disk holds them."""
    # pylint: disable=import-outside-toplevel
    import ray.train
    from ray.train.tensorflow import TensorflowTrainer
    from ray.train.v2.api import data_parallel_trainer

    failure_config = ray.train.FailureConfig(max_failures=max_failures)
    # Ray builds the policy from the FailureConfig in `fit()`, in this process, and sends it
    # to its controller: ours in its place (tested with Ray 2.60, `make test-ray`).
    data_parallel_trainer.create_failure_policy = _failure_policy
    return TensorflowTrainer(
        loop, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers,
                                               resources_per_worker={"CPU": cpus_per_worker}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage_path,
                                       failure_config=failure_config),
    )


def main(argv=None) -> int:
    """Console script `distrib-tf-ray`: the main job on a Ray cluster."""
    parser = argparsing.Parser(
        prog="distrib-tf-ray", description="Runs the main job under Ray Train.",
        usage="distrib-tf-ray [--address=auto] --num_workers=N|MIN:MAX [--script=PATH] -- [flags]")
    parser.add_argument("--address", default="auto", help="the Ray cluster (ray.init's address)")
    parser.add_argument("--num_workers", required=True, help="N, or MIN:MAX for Ray Train's elastic group")
    parser.add_argument("--cpus_per_worker", type=float, default=1, help="CPUs Ray reserves for each worker")
    parser.add_argument("--max_failures", type=int, default=3,
                        help="restarts of the worker group Ray Train allows after a failure")
    parser.add_argument("--storage_path", default=os.path.abspath("runs/ray"),
                        help="where Ray keeps the run and its checkpoint (a path every node sees)")
    parser.add_argument("--name", default="distrib_tf", help="the run's name under --storage_path")
    parser.add_argument("--script", default=None,
                        help="a user's script on distrib_tf.Run instead of the main job; the flags go to it")
    parser.add_argument("--events", default=None, help="append every rank's events (JSON lines, "
                        "distrib_tf.events) to FILE, on a disk every node sees (a sweep's trial)")
    parser.add_argument("job_flags", nargs="*", help="-- flags for the main job (or the script)")
    args = parser.parse_args(argv)
    try:
        num_workers = parse_num_workers(args.num_workers)
    except ValueError as e:
        parser.error(str(e))
    if args.script and not os.path.isfile(args.script):
        parser.error(f"--script: got {args.script!r}, expected a Python file on every node")
    import ray  # pylint: disable=import-outside-toplevel

    try:
        ray.init(address=args.address, log_to_driver=True)
    except Exception as e:  # pylint: disable=broad-except  (one line, not a traceback: issue 33 item 8)
        if type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e):
            print(f"distrib-tf-ray: error: The Ray cluster at --address={args.address!r} refused this client's "
                  f"authentication token: {str(e).splitlines()[0][:200]}. Expected the cluster's own token: set "
                  "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to it, or move away a ~/.ray/auth_token that an earlier "
                  "local ray.init() left.", file=sys.stderr)
            return exit_codes.USAGE
        if not isinstance(e, (ConnectionError, RuntimeError, ValueError)):
            raise
        print(f"distrib-tf-ray: error: Cannot connect to the Ray cluster at --address={args.address!r}: "
              f"{str(e).splitlines()[0][:200]}. Expected a running cluster (`ray start --head`) or "
              "--address=local.", file=sys.stderr)
        return exit_codes.USAGE
    try:
        result = trainer(main_job_loop, num_workers=num_workers,
                         config={"argv": args.job_flags, "script": args.script and os.path.abspath(args.script),
                                 "events": args.events and os.path.abspath(args.events)},
                         storage_path=args.storage_path,
                         name=args.name, max_failures=args.max_failures,
                         cpus_per_worker=args.cpus_per_worker).fit()
    except Exception as e:  # pylint: disable=broad-except  (Ray's TrainingFailedError)
        codes = [exit_code_of(f) for f in getattr(e, "worker_failures", {}).values()]
        code = next((c for c in codes if c in PERMANENT), None)
        print(f"distrib-tf-ray: the run failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return code if code is not None else exit_codes.FAILED
    print(json.dumps({"metrics": result.metrics,
                      "checkpoint": result.checkpoint.path if result.checkpoint else None}))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
