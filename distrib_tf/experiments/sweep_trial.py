"""One trial of a sweep: started through the launcher on its slots, followed through its events.

`Sweep.launch` starts the trial's launcher with the trial in its environment
(`distrib_tf.trial`: its values, directory, the study's URL) on the trial's local ranks;
`Sweep.follow` reports each epoch of every `fit` to Optuna and writes the pruner's word
into the study. A sweep killed by SIGKILL leaves its launchers backing up and stopping:
`wait_for_earlier` keeps the same command, started again at once, from running a second
copy beside them. This module imports no TensorFlow.
"""

import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

from distrib_tf import events
from distrib_tf import lifeline
from distrib_tf import study as study_lib
from distrib_tf import trial as trial_lib
from distrib_tf.experiments import sweep_promotion
from distrib_tf.experiments import sweep_results
from distrib_tf.experiments.sweep_space import Dimension

LAUNCHER = "launcher.json"  # In a trial's directory: its launcher's pid and start time, while it may run.
EARLIER_SECONDS = 300.0  # The longest a trial waits for the launcher of a killed sweep to end.
CHIEFS = sweep_results.CHIEFS
# Between a trial's SIGTERM and SIGKILL: a one-worker trial leaves through the interpreter's
# teardown after its backup, measured at 8 to 10 s on a loaded 2-core machine (it exited 130,
# "not every task saved", with 10 s, though its backup was on the disk).
GRACE_SECONDS = 30.0


@dataclasses.dataclass
class Trial:
    number: int
    values: dict
    model_dir: str
    status: str = "pending"
    cause: str = ""
    curve: dict = dataclasses.field(default_factory=dict)  # Step -> the metric, from the events.
    steps: dict = dataclasses.field(default_factory=dict)  # (fit, epoch) -> step (`sweep_results.step_of`).
    words: dict = dataclasses.field(default_factory=dict)  # The words said on it (`distrib_tf.study`).
    reported: set = dataclasses.field(default_factory=set)  # Steps Optuna holds (a followed job's, before).
    at: tuple = (1, 0)  # The (fit, epoch) of its last epoch event.
    logged: tuple = ()  # The metrics its chief's epochs log, for a metric they do not.
    epochs: int = 0
    step: str = ""
    proc: subprocess.Popen | None = None  # Its launcher, on this host's slots.
    job: str = ""  # Its job, on an engine (`distrib_tf.experiments.sweep_engines`).
    submitted: float = 0.0  # When its job was submitted (Unix seconds).
    started: float = 0.0
    promoted: int = 0  # The step a promoted attempt resumes after (`sweep_promotion`), else 0.
    paused: bool = False  # Its attempt paused at a rung, to be promoted if it ranks there later.

    @property
    def id(self) -> str:
        return sweep_results.trial_id(self.values)


class TrialFailed(Exception):
    """A trial that ended without its metric: Optuna records it as failed."""


@dataclasses.dataclass
class Sweep:
    """What every trial of a sweep shares."""

    space: list[Dimension]
    sweep_dir: str
    command: list[str]  # The trial's program: the user's script, or the main job.
    where: list[str]  # The launcher's flags that say on what the trial runs.
    metric: str
    mode: str
    prunes: bool
    say: object = print
    storage: str = ""  # The study's URL, which every trial's chief is told (`distrib_tf.study`).
    study_name: str = "distrib_tf"
    workers: int = 0  # Of each trial when trials share the host's slots (`--workers`), else 0.
    parallel: int = 1
    engine: object = None  # Where trials run off this host (`sweep_engines`), or None: the host's slots.
    sampler: str = "grid"
    ladder: sweep_promotion.Ladder | None = None  # With `--promote`: the rungs that pause and promote.

    def placement(self, slot: int) -> list[str]:
        """The launcher's flags for the trial on the `slot`-th group of slots: trials side by side
        take disjoint local ranks, so disjoint GPUs and CPUs (`distrib_tf.launch.placement`)."""
        # A chief in a private network namespace (loopback only) cannot reach a database server.
        network = ["--network=host"] if self.prunes and self.storage.startswith("postgresql") else []
        if not self.workers:
            return [*self.where, *network]
        return [*self.where, *network, f"--local_rank_offset={slot * self.workers}",
                f"--local_world_size={self.parallel * self.workers}"]

    def launch(self, trial: Trial, slot: int = 0) -> None:
        os.makedirs(trial.model_dir, exist_ok=True)
        log = open(os.path.join(trial.model_dir, "trial.log"), "a", encoding="utf-8")  # pylint: disable=consider-using-with
        command = [sys.executable, "-m", "distrib_tf.launch", *self.placement(slot),
                   f"--grace_period={GRACE_SECONDS:g}",
                   f"--events={os.path.join(trial.model_dir, 'events.jsonl')}", "--", *self.command]
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        env = {**os.environ, lifeline.PARENT_ENV: str(os.getpid()),  # It backs up and stops when the sweep dies.
               trial_lib.ENV: json.dumps({"number": trial.number, "params": trial.values, "dir": trial.model_dir,
                                          "prune": self.prunes, "storage": self.storage, "study": self.study_name})}
        trial.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        with open(os.path.join(trial.model_dir, LAUNCHER), "w", encoding="utf-8") as f:
            json.dump({"pid": trial.proc.pid, "started": _started(trial.proc.pid)}, f)
        trial.started, trial.status = time.monotonic(), "running"

    def follow(self, trial: Trial, asked, follower, board) -> None:
        """Reports each new epoch's metric to Optuna, keyed by fit and epoch (`sweep_results.step_of`),
        and writes the pruner's word on it into the study, where the trial's chief reads it."""
        for event in follower():
            if event["event"] == "progress" and event.get("task") in CHIEFS:
                trial.step = f"epoch {event['epoch']}/{event['epochs']} step {event['step']}/{event['steps']}"
            if event["event"] != "epoch" or event.get("task") not in CHIEFS:
                continue
            step, new = sweep_results.step_of(trial.steps, event)
            if not new:  # An epoch run again (a rollback, a resume): reported once.
                continue
            fit, epoch = trial.at = event.get("fit", 1), event["epoch"]
            value = event.get("metrics", {}).get(self.metric)
            trial.epochs = event.get("epochs", trial.epochs)
            trial.logged = tuple(sorted(k for k in event.get("metrics", {}) if not k.startswith("step_seconds")))
            usable = value is not None and math.isfinite(value)
            if usable:
                trial.curve[step] = value
                if step not in trial.reported:  # A job followed again: what the earlier sweep reported stands.
                    asked.report(value, step)
                if step > trial.promoted:  # A promoted attempt's earlier epochs were said.
                    board.epoch(trial, epoch, value, fit=fit)
            key = study_lib.word_key(fit, epoch)
            if self.prunes and key not in trial.words:  # An epoch of an earlier attempt keeps its word.
                # Without the metric (a NaN, or a name its epochs do not log) the trial goes on:
                # it ends failed, saying which metrics it logs, instead of waiting for a word.
                trial.words[key] = self._word(asked, trial, step, epoch) if usable else "go"
                asked.set_user_attr(key, trial.words[key])

    def _word(self, asked, trial: Trial, step: int, epoch: int) -> str:
        """The pruner's word on the trial's `step` (`epoch` of its fit); with a ladder, a fit's
        last epoch is never a rung, and a pause is recorded on the attempt."""
        if self.ladder is None:
            return "prune" if asked.should_prune() else "go"
        study = asked.study
        if trial.epochs and sweep_promotion.EPOCHS not in study.user_attrs:
            study.set_user_attr(sweep_promotion.EPOCHS, trial.epochs)  # Hyperband's brackets from now on.
        everyone = sweep_promotion.values_of(study)
        me = next(v for v in everyone if sweep_results.trial_id(v.params) == trial.id)
        if me.bracket is None:  # Its first judgement: its turn among the brackets.
            me.bracket = self.ladder.bracket_of(everyone, me, study.user_attrs.get(sweep_promotion.EPOCHS))
            asked.set_user_attr(sweep_promotion.BRACKET, me.bracket)
        if epoch >= trial.epochs:
            return "go"
        word = self.ladder.word(everyone, me, step)
        if word == "prune":
            asked.set_user_attr(sweep_promotion.PAUSED, step)
            trial.paused = True
        return word


def _started(pid: int) -> str | None:
    """A process's start time (in clock ticks since boot, from /proc), or `None` if it is gone
    (a zombie too: an orphan's parent need not reap it at once)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def wait_for_earlier(model_dir: str, *, say, timeout: float = EARLIER_SECONDS, stopping=None) -> None:
    """Returns once no launcher that an earlier sweep started in `model_dir` runs: a sweep killed
    by SIGKILL leaves its trials backing up and stopping (their launchers got SIGTERM), and the
    same command started at once must not run a second copy beside them. After `timeout`
    seconds the earlier launcher's process group is killed."""
    try:
        with open(os.path.join(model_dir, LAUNCHER), encoding="utf-8") as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        return
    if earlier.get("started") is None or _started(earlier["pid"]) != earlier["started"]:
        return
    say(f"{model_dir}: waits for the launcher of the sweep before (pid {earlier['pid']}) to back up and stop")
    deadline = time.monotonic() + timeout
    while _started(earlier["pid"]) == earlier["started"] and not (stopping and stopping.is_set()):
        if time.monotonic() > deadline:
            say(f"{model_dir}: the earlier launcher (pid {earlier['pid']}) did not stop in {timeout:.0f} s: killed")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(earlier["pid"], signal.SIGKILL)
            deadline = math.inf
        time.sleep(0.2)


def root_cause(model_dir: str) -> str:
    """The launcher's root cause from the trial's event stream, or the log's last line."""
    ends = [e for e in events.read(os.path.join(model_dir, "events.jsonl")) if e["event"] == "job_end"]
    if ends and ends[-1].get("root_cause"):
        return ends[-1]["root_cause"][:300]
    try:
        with open(os.path.join(model_dir, "trial.log"), encoding="utf-8", errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:  # A job the engine deleted before its output was collected.
        lines = []
    return lines[-1][:300] if lines else "no output"  # Bad input: the launcher's one line.
