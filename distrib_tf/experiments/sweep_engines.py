"""Where a sweep's trials run when not on this host's slots: the engines users already run.

- `--engine=slurm` (`SlurmEngine`): each trial is the job `distrib-tf-export slurm` writes
  (`distrib_tf.deploy.slurm.batch_script`) with the trial's values and directory, submitted,
  followed, cancelled and collected through Slurm's own commands: `sbatch`, `squeue`,
  `scontrol show job` (its exit code), `scancel`.
- `--engine=kubernetes` (`distrib_tf.experiments.sweep_kubernetes.KubernetesEngine`): each
  trial the Indexed Job `distrib-tf-export kubernetes` writes, through `kubectl`.
- `--engine=ray` (`RayEngine`): each trial is the Ray Train run `distrib-tf-ray` starts
  (`distrib_tf.deploy.ray_train`), submitted, followed, stopped and collected (its driver's
  exit code and logs) through Ray's job API.

The sweep never needs a shell on the nodes. What the nodes must share with the sweep: the
sweep's directory (each trial writes its backups, `events.jsonl` and `trial.log` there, and
the sweep reads them) and the study (PostgreSQL, or a journal file on that shared disk:
SQLite is refused), which the trial's chief reads the pruner's word from.

The sweep's process is disposable: a job, once submitted, belongs to the engine. Killed
(SIGKILL included), the sweep leaves its trials running; the study keeps each running
trial with its job (`job` user attribute, `ENGINE:ID`), and the same command started again
follows those jobs (their events from the start, the words already said kept) instead of
running them again, and collects those that ended meanwhile. A chief whose sweep is gone
waits for the word on an epoch up to `distrib_tf.keras.pruning.DECISION_SECONDS`, then
goes on. Ctrl-C or SIGTERM to the sweep cancels its jobs (`scancel`: each task backs up one
step and stops; Ray's `stop_job`), and the same command resumes them from their backups.

This module imports no TensorFlow (nor Ray until `--engine=ray` asks for it).
"""

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

from distrib_tf import events
from distrib_tf import exit_codes
from distrib_tf import lifeline
from distrib_tf import trial as trial_lib
from distrib_tf.cluster import ClusterSpec
from distrib_tf.deploy import slurm

ENGINES = ("local", "slurm", "kubernetes", "ray")
POLL_SECONDS = 2.0  # Between two questions to the engine about one job.
COMMAND_SECONDS = 60  # The longest one of the engine's commands is waited for.
JOB_FILE = "job.json"  # In a trial's directory: the engine's job that runs it.


class EngineError(RuntimeError):
    """An engine's command failed (one line: the command and what it said)."""


def run_command(command: list[str], *, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=COMMAND_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineError(f"`{command[0]}` did not answer: {e}") from e


def said(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr.strip() or result.stdout.strip() or f"exit code {result.returncode}").splitlines()
    return lines[-1][:300]


def trial_environment(trial, sweep) -> dict:
    """The environment a trial's tasks get on any engine: the trial (`distrib_tf.trial`), and the
    sweep's interpreter first on PATH (the engine's tasks run `distrib-tf-launch`). No
    parent pid to watch: the sweep's process is not on the trial's nodes."""
    env = {k: v for k, v in os.environ.items() if k != lifeline.PARENT_ENV}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env[trial_lib.ENV] = json.dumps({"number": trial.number, "params": trial.values, "dir": trial.model_dir,
                                     "prune": sweep.prunes, "storage": sweep.storage, "study": sweep.study_name})
    return env


@dataclasses.dataclass(frozen=True)
class SlurmEngine:
    """Each trial a batch job of `workers` tasks (on `nodes` nodes, when given), submitted with
    `sbatch`.

    Example:

        engine = SlurmEngine(workers=2, nodes=2)
        job = engine.submit(trial, sweep)   # "slurm:1234"
        engine.poll(job, trial.model_dir)   # None while queued or running, then its exit code
    """

    workers: int
    nodes: int = 0  # 0: wherever Slurm puts the tasks.
    name = "slurm"
    COMMANDS = ("sbatch", "squeue", "scontrol", "scancel")

    def __post_init__(self):
        if self.nodes and self.workers % self.nodes:
            raise ValueError(f"Invalid value for `--nodes_per_trial`. Received: {self.nodes}. Expected a divisor "
                             f"of --workers_per_trial={self.workers} (the same number of tasks on each node).")

    def check(self) -> None:
        """Raises a one-line `ValueError` when Slurm's commands are not on PATH."""
        missing = [c for c in self.COMMANDS if shutil.which(c) is None]
        if missing:
            raise ValueError(f"Invalid value for `--engine`. Received: slurm, but no {', '.join(missing)} on "
                             f"PATH. Expected Slurm's commands ({', '.join(self.COMMANDS)}) on this host "
                             "(apt-get install slurm-client), or --engine=local.")

    def script(self, trial, sweep) -> str:
        """The trial's batch script: `distrib-tf-export slurm`'s, its events in the trial's directory."""
        nodes = (self.nodes, self.nodes) if self.nodes else None
        spec = None if nodes else ClusterSpec.local_workers(self.workers)
        return slurm.batch_script(spec, command=sweep.command, job_name=job_name(sweep.study_name, trial.id),
                                  nodes=nodes, tasks_per_node=self.workers // max(self.nodes, 1),
                                  launcher_options=(f"--events={os.path.join(trial.model_dir, 'events.jsonl')}",))

    def submit(self, trial, sweep) -> str:
        """Writes `job.sbatch` into the trial's directory and submits it: the job's id, `slurm:ID`."""
        path = os.path.join(trial.model_dir, "job.sbatch")
        try:
            os.makedirs(trial.model_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.script(trial, sweep))
        except OSError as e:
            raise EngineError(f"cannot write {path}: {e.strerror}") from e
        result = run_command(["sbatch", "--parsable", f"--output={os.path.join(trial.model_dir, 'trial.log')}",
                       "--open-mode=append", path], env=trial_environment(trial, sweep))
        found = result.stdout.strip().split(";")[0]
        if result.returncode != 0 or not found.isdigit():
            raise EngineError(f"sbatch refused trial {trial.number}: {said(result)}")
        return f"slurm:{found}"

    def poll(self, job: str, model_dir: str) -> int | None:  # pylint: disable=unused-argument
        """`None` while the job is queued, running or requeued; then its exit code (a signal's
        as 128 + its number). A job Slurm has forgotten (`MinJobAge` after its end) gives the
        largest exit code its tasks' launchers wrote into the trial's events, if any."""
        number = job.removeprefix("slurm:")
        result = run_command(["squeue", "-h", "-j", number, "-t", "all", "-o", "%T"])
        state = result.stdout.strip()
        if result.returncode == 0 and state and state not in ENDED:
            return None
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            return None  # The controller busy or restarting: ask again.
        shown = run_command(["scontrol", "show", "job", "-o", number])
        found = re.search(r"\bExitCode=(\d+):(\d+)", shown.stdout)
        if shown.returncode == 0 and found:
            code, signal_number = int(found.group(1)), int(found.group(2))
            return 128 + signal_number if signal_number else code
        return None if state else GONE

    def cancel(self, job: str) -> None:
        """`scancel`: every task gets SIGTERM, backs up one step and stops (within Slurm's `KillWait`)."""
        result = run_command(["scancel", job.removeprefix("slurm:")])
        if result.returncode != 0:
            raise EngineError(f"scancel {job}: {said(result)}")


class RayEngine:
    """Each trial a Ray Train run of `workers` ranks (`distrib-tf-ray`, the main job or the
    user's script on `distrib_tf.Run`), submitted through Ray's job API
    (`ray.job_submission.JobSubmissionClient`) at `address` (the dashboard's, such as
    `http://HEAD:8265`; default: `RAY_ADDRESS`, else a cluster on this host).

    Example:

        engine = RayEngine(workers=2, address="http://10.0.0.1:8265")
        job = engine.submit(trial, sweep)   # "ray:distrib_tf-0a1b2c3d4e-7"
        engine.poll(job, trial.model_dir)   # None while pending or running, then its exit code
    """

    name = "ray"

    def __init__(self, *, workers: int, address: str | None = None):
        self.workers, self.address, self._client = workers, address, None

    def __repr__(self) -> str:
        return f"RayEngine(workers={self.workers}, address={self.address!r})"

    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient  # pylint: disable=import-outside-toplevel
            self._client = JobSubmissionClient(self.address)
        return self._client

    def check(self) -> None:
        """Raises a one-line `ValueError` when Ray is missing or its job API does not answer."""
        try:
            import ray.job_submission  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError as e:
            raise ValueError("Invalid value for `--engine`. Received: ray, but Ray is not installed here. Expected "
                             "Ray's job API: pip install 'distrib_tf[ray]', or --engine=local.") from e
        try:
            self.client()
        except Exception as e:  # pylint: disable=broad-except  # ConnectionError, RuntimeError: no job API there.
            reason = " ".join(str(e).split())[:200]
            raise ValueError(f"Invalid value for `--ray_address`. Received: {self.address or 'RAY_ADDRESS'} "
                             f"({reason}). Expected the dashboard of a running Ray cluster, whose job API takes "
                             "the trials: http://HEAD:8265.") from e

    def entrypoint(self, trial, sweep) -> list[str]:
        """The trial's job: `distrib-tf-ray` on `workers` ranks, its events in the trial's directory."""
        program = sweep.command
        if program[1:3] == ["-m", "distrib_tf.train"]:
            script, argv = [], program[3:]
        else:
            script, argv = [f"--script={program[1]}"], program[2:]
        return [sys.executable, "-m", "distrib_tf.deploy.ray_train", "--address=auto", f"--num_workers={self.workers}",
                f"--storage_path={os.path.join(sweep.sweep_dir, 'ray')}", f"--name=trial-{trial.id}-{trial.number}",
                f"--events={os.path.join(trial.model_dir, 'events.jsonl')}", *script, "--", *argv]

    def submit(self, trial, sweep) -> str:
        os.makedirs(trial.model_dir, exist_ok=True)
        entrypoint = shlex.join(self.entrypoint(trial, sweep))
        with open(os.path.join(trial.model_dir, "trial.log"), "a", encoding="utf-8") as f:
            f.write(f"$ {entrypoint}\n")
        environment = trial_environment(trial, sweep)
        try:
            found = self.client().submit_job(
                entrypoint=entrypoint, submission_id=f"{job_name(sweep.study_name, trial.id)}-{trial.number}",
                runtime_env={"env_vars": {trial_lib.ENV: environment[trial_lib.ENV]}})
        except Exception as e:  # pylint: disable=broad-except  # Ray's RuntimeError, a refused connection.
            raise EngineError(f"Ray's job API refused trial {trial.number}: {' '.join(str(e).split())[:300]}") from e
        return f"ray:{found}"

    def poll(self, job: str, model_dir: str) -> int | None:
        """`None` while the job is pending or running; then the exit code of its driver
        (`distrib-tf-ray`: 0, or the main job's code, such as 3 when pruned), its logs appended
        to the trial's `trial.log`."""
        from ray.job_submission import JobStatus  # pylint: disable=import-outside-toplevel

        submission = job.removeprefix("ray:")
        try:
            status = self.client().get_job_status(submission)
        except RuntimeError as e:
            if "does not exist" in str(e):
                return GONE
            raise EngineError(str(e)) from e
        except Exception as e:  # pylint: disable=broad-except  # The head busy or restarting: ask again.
            raise EngineError(str(e)) from e
        if not status.is_terminal():
            return None
        info = self.client().get_job_info(submission)
        with open(os.path.join(model_dir, "trial.log"), "a", encoding="utf-8") as f:
            f.write(self.client().get_job_logs(submission))
        if status == JobStatus.SUCCEEDED:
            return exit_codes.OK
        if info.driver_exit_code is not None:
            return info.driver_exit_code
        return 128 + 15 if status == JobStatus.STOPPED else exit_codes.FAILED

    def cancel(self, job: str) -> None:
        """Ray's `stop_job`: its driver gets SIGTERM, then SIGKILL after Ray's
        `RAY_JOB_STOP_WAIT_TIME_S`; each task, its Ray worker gone, gets SIGTERM and backs up."""
        try:
            self.client().stop_job(job.removeprefix("ray:"))
        except Exception as e:  # pylint: disable=broad-except
            raise EngineError(f"stop_job {job}: {' '.join(str(e).split())[:300]}") from e


# Slurm's job states once the job's batch script and steps are over.
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT")
GONE = -1  # `poll`: the engine no longer knows the job; its trial's events tell.


def job_name(study_name: str, trial_id: str) -> str:
    """The engine's name for a trial's job: the study's name (letters, digits, `_.-`) and the
    trial's id. Pure.

    Example:

        >>> job_name("my sweep", "0a1b2c3d4e")
        'my_sweep-0a1b2c3d4e'
    """
    return (re.sub(r"[^A-Za-z0-9_.-]", "_", study_name)[:100].lstrip("_.-") or "sweep") + f"-{trial_id}"


def exit_code_from_events(model_dir: str, since: float = 0.0) -> int:
    """The exit code of a trial's job from its launchers' `job_end` events after `since` (Unix
    seconds): the largest among each launcher's last (a pod preempted, 75, then recreated and
    finished, 0, ended with 0), or 1 (failed) if none."""
    last = {}
    for i, e in enumerate(events.read(os.path.join(model_dir, "events.jsonl"))):
        if e["event"] == "job_end" and e.get("time", 0) >= since:
            last[tuple(e["tasks"]) if "tasks" in e else i] = e.get("exit_code", exit_codes.FAILED)
    return max(last.values()) if last else exit_codes.FAILED


def record_job(model_dir: str, job: str) -> None:
    with open(os.path.join(model_dir, JOB_FILE), "w", encoding="utf-8") as f:
        json.dump({"job": job}, f)
