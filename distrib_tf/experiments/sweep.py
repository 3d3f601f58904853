"""Hyperparameter sweeps of your own script, each trial a distributed run.

Usage:

    distrib-tf-sweep --space='learning_rate=loguniform(1e-4,1e-2) units=[32,64]' --trials=8 \\
        --sampler=tpe --pruner=median --metric=val_accuracy [--cluster_spec=local_4workers \\
        --workers_per_trial=2] [--sweep_dir=runs/sweep] -- python my_script.py [ITS ARGS]

The script declares its hyperparameters with `hp = distrib_tf.params(learning_rate=1e-3,
units=64)` (`distrib_tf.trial`): outside a sweep they are its defaults; in a trial the
sweep's values, the same on every worker by construction (they travel in the launcher's
environment). Without a command after `--` (or with only flags there), the trial is the
main job (`python -m distrib_tf.train`) and `--space` names its flags.

Each trial is the command run by the launcher on `--workers_per_trial` local workers (or on
every task of the cluster spec), in its own directory `SWEEP_DIR/trial-<id>` (the id a hash
of its values), where `distrib_tf.Run` writes instead of its `model_dir`. The spec's local
tasks are the slots: trials run side by side as many at once as fit (4 slots: two 2-worker
trials), never two on one slot.

The objective is `--metric` (any metric of the run's epochs: `val_loss`, a user's metric)
as the run's chief reported it in its `epoch` events (`distrib_tf.events`), the best epoch's
(`--mode=max|min`). With `--pruner` (Optuna's median, successive halving or Hyperband),
each epoch's value is reported as it arrives; a trial the pruner stops ends on every worker
at that epoch's end with exit code 3 (`distrib_tf.keras.pruning`), its state kept.

Built on Optuna (`pip install 'distrib_tf[sweep]'`), whose study in `SWEEP_DIR/study.db`
(SQLite) records every trial. The sweep survives anything: its own process killed (its
trials then back up and stop: their launchers die with it), the same command goes on:
finished and pruned trials stay, an interrupted one resumes from its backups at its step,
the sampler goes on (seeded by the trials so far), and a grid runs in the order written.
A trial that fails for its own reason (a NaN, a bad value) is recorded with its cause and
the sweep goes on. Results (`distrib_tf.experiments.sweep_results`): `results.csv`, a live
line, and `sweep.png`. Bad input prints one line and exits 2 before anything starts. Exit
codes: 0 every trial finished or was pruned; 1 some failed; 2 bad input; 75 SIGTERM, every
running trial backed up (start it again); 130 interrupted.

This module imports no TensorFlow.
"""

import dataclasses
import itertools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from distrib_tf import argparsing
from distrib_tf import events
from distrib_tf import exit_codes
from distrib_tf import lifeline
from distrib_tf import trial as trial_lib
from distrib_tf.cluster import ClusterSpec
from distrib_tf.experiments import sweep_results
from distrib_tf.experiments.sweep_space import SWEEPABLE
from distrib_tf.experiments.sweep_space import Dimension
from distrib_tf.experiments.sweep_space import grid_size
from distrib_tf.experiments.sweep_space import parse_space
from distrib_tf.experiments.sweep_space import suggest

PRUNERS = ("none", "median", "halving", "hyperband")
CHIEFS = sweep_results.CHIEFS


def _optuna():
    try:
        import optuna  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ValueError("Missing Optuna, which sweeps are built on. Expected it installed: "
                         "pip install 'distrib_tf[sweep]'.") from e
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # The sweep says what each trial did.
    return optuna


def make_pruner(name: str, *, startup_trials: int = 2, warmup_epochs: int = 0):
    """Optuna's pruner called `name` (`PRUNERS`)."""
    pruners = _optuna().pruners
    return {"none": pruners.NopPruner,
            "median": lambda: pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_epochs),
            "halving": lambda: pruners.SuccessiveHalvingPruner(min_resource=max(1, warmup_epochs)),
            "hyperband": lambda: pruners.HyperbandPruner(min_resource=max(1, warmup_epochs))}[name]()


def open_study(sweep_dir: str, space: list[Dimension], *, sampler: str, seed: int, mode: str,
               pruner: str = "none", startup_trials: int = 2, warmup_epochs: int = 0):
    """The sweep's Optuna study, in `sweep_dir/study.db` (SQLite): created, or loaded to go on.

    A grid is enqueued once, in the order written (the last name varies fastest); a random
    or TPE sampler is seeded with `seed` plus the trials the study holds, so that a sweep
    started again goes on drawing instead of repeating its first values.
    """
    optuna = _optuna()
    storage = "sqlite:///" + os.path.abspath(os.path.join(sweep_dir, "study.db"))
    study = optuna.create_study(study_name="distrib_tf", storage=storage, load_if_exists=True,
                                direction="maximize" if mode == "max" else "minimize",
                                pruner=make_pruner(pruner, startup_trials=startup_trials, warmup_epochs=warmup_epochs))
    so_far = len(study.get_trials(deepcopy=False))
    study.sampler = (optuna.samplers.TPESampler if sampler == "tpe" else optuna.samplers.RandomSampler)(
        seed=seed + so_far)
    if sampler == "grid" and not so_far:
        for point in itertools.product(*(d.values for d in space)):
            study.enqueue_trial(dict(zip([d.name for d in space], point)))
    return study


@dataclasses.dataclass
class Trial:
    number: int
    values: dict
    model_dir: str
    status: str = "pending"
    cause: str = ""
    curve: dict = dataclasses.field(default_factory=dict)  # Epoch -> the metric, from the events.
    logged: tuple = ()  # The metrics its chief's epochs log, for a metric they do not.
    epochs: int = 0
    step: str = ""
    proc: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def id(self) -> str:
        return sweep_results.trial_id(self.values)


class _TrialFailed(Exception):
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

    def launch(self, trial: Trial) -> None:
        os.makedirs(trial.model_dir, exist_ok=True)
        log = open(os.path.join(trial.model_dir, "trial.log"), "a", encoding="utf-8")  # pylint: disable=consider-using-with
        command = [sys.executable, "-m", "distrib_tf.launch", *self.where, "--grace_period=10",
                   f"--events={os.path.join(trial.model_dir, 'events.jsonl')}", "--", *self.command]
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        env = {**os.environ, lifeline.PARENT_ENV: str(os.getpid()),  # It backs up and stops when the sweep dies.
               trial_lib.ENV: json.dumps({"number": trial.number, "params": trial.values, "dir": trial.model_dir,
                                          "prune": self.prunes})}
        trial.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        trial.started, trial.status = time.monotonic(), "running"

    def follow(self, trial: Trial, asked, follower, board) -> None:
        """Reports each new epoch's metric to Optuna and writes the pruner's word on it."""
        for event in follower():
            if event["event"] == "progress" and event.get("task") in CHIEFS:
                trial.step = f"epoch {event['epoch']}/{event['epochs']} step {event['step']}/{event['steps']}"
            if event["event"] != "epoch" or event.get("task") not in CHIEFS or event["epoch"] in trial.curve:
                continue
            value = event.get("metrics", {}).get(self.metric)
            trial.epochs = event.get("epochs", trial.epochs)
            trial.logged = tuple(sorted(k for k in event.get("metrics", {}) if not k.startswith("step_seconds")))
            usable = value is not None and math.isfinite(value)
            if usable:
                trial.curve[event["epoch"]] = value
                asked.report(value, event["epoch"])
                board.epoch(trial, event["epoch"], value)
            decided = os.path.exists(os.path.join(trial.model_dir, trial_lib.DECISIONS, f"epoch-{event['epoch']}"))
            if self.prunes and not decided:  # An epoch of an earlier attempt keeps its word.
                # Without the metric (a NaN, or a name its epochs do not log) the trial goes on:
                # it ends failed, saying which metrics it logs, instead of waiting for a word.
                trial_lib.write_decision(trial.model_dir, event["epoch"], usable and asked.should_prune())


def _root_cause(model_dir: str) -> str:
    """The launcher's root cause from the trial's event stream, or the log's last line."""
    ends = [e for e in events.read(os.path.join(model_dir, "events.jsonl")) if e["event"] == "job_end"]
    if ends and ends[-1].get("root_cause"):
        return ends[-1]["root_cause"][:300]
    with open(os.path.join(model_dir, "trial.log"), encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"  # Bad input: the launcher's one line.


def _leftovers(study, optuna) -> tuple[list, list[dict]]:
    """The trials that count against the budget, and the values of interrupted ones to run
    again. A trial left running by a sweep that was killed is told failed (it has no cause:
    interrupted), and its values run again, resumed from their backups."""
    states = optuna.trial.TrialState
    for old in study.get_trials(deepcopy=False, states=(states.RUNNING,)):
        study.tell(old.number, state=states.FAIL)
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state in (states.COMPLETE, states.PRUNED)
            or (t.state == states.FAIL and "cause" in t.user_attrs)]
    covered = [t.params for t in done] + [t.params for t in trials if t.state == states.WAITING]
    retry = []
    for t in trials:
        if t.state == states.FAIL and "cause" not in t.user_attrs and t.params not in covered + retry and t.params:
            retry.append(t.params)
    return done, retry


def run_sweep(study, sweep: Sweep, *, total: int, parallel: int, board) -> int:
    """Runs `study` up to `total` trials, `parallel` at a time, each a distributed run.

    Returns 0 once it ran to the end; interrupted (Ctrl-C or SIGTERM, the running trials
    told to back up and stop, and stopped), 75 for a SIGTERM that every trial saved on, else 130.
    """
    optuna = _optuna()
    done, retry = _leftovers(study, optuna)
    for values in retry:
        study.enqueue_trial(values)
    ended = {sweep_results.trial_id(t.params): (t.state.name, t.value, t.number) for t in done}
    running: dict[int, Trial] = {}
    lock, stopping = threading.RLock(), threading.Event()
    received: list[int] = []
    codes: list[int] = []  # The exit codes of the trials the sweep's interruption stopped.

    def objective(asked):
        values = suggest(asked, sweep.space)
        trial = Trial(asked.number, values, os.path.join(sweep.sweep_dir, f"trial-{sweep_results.trial_id(values)}"))
        if trial.id in ended:  # A draw that repeats an ended trial: its result, not a second run.
            state, value, number = ended[trial.id]
            sweep.say(f"trial {trial.number} {values}: the same as trial {number}, not run again")
            asked.set_user_attr("same_as", number)
            if state == "PRUNED":
                raise optuna.TrialPruned()
            if state != "COMPLETE":
                asked.set_user_attr("cause", f"the same as trial {number}")
                raise _TrialFailed()
            return value
        asked.set_user_attr("dir", trial.model_dir)
        resumed = os.path.isdir(os.path.join(trial.model_dir, "backup"))
        with lock:
            if stopping.is_set():
                study.stop()
                raise _TrialFailed("the sweep was interrupted")
            sweep.launch(trial)
            running[asked.number] = trial
        board.started(trial, resumed)
        follower = events.Follower(os.path.join(trial.model_dir, "events.jsonl"))
        while trial.proc.poll() is None:
            sweep.follow(trial, asked, follower, board)
            time.sleep(0.2)
        sweep.follow(trial, asked, follower, board)
        code = trial.proc.returncode
        with lock:
            del running[asked.number]
        seconds = time.monotonic() - trial.started
        best = sweep_results.best(trial.curve, sweep.mode)
        if code == exit_codes.PRUNED:
            trial.status = "pruned"
        elif code == exit_codes.OK and best is not None:
            trial.status = "finished"
        elif stopping.is_set() or code in (exit_codes.PREEMPTED, exit_codes.INTERRUPTED):
            trial.status = "interrupted"
            codes.append(code)
        else:
            trial.status = "failed"
            trial.cause = _root_cause(trial.model_dir) if code else (
                f"no {sweep.metric} in its epochs (the metrics its chief reported: "
                f"{', '.join(trial.logged) or 'none'})")
        board.ended(trial, seconds)
        if trial.status == "interrupted":
            raise _TrialFailed("interrupted")
        ended[trial.id] = ({"pruned": "PRUNED", "failed": "FAIL"}.get(trial.status, "COMPLETE"), best, trial.number)
        if trial.status == "pruned":
            raise optuna.TrialPruned()
        if trial.status == "failed":
            asked.set_user_attr("cause", trial.cause)
            raise _TrialFailed(trial.cause)
        return best

    def interrupt(signum, frame):
        stopping.set()
        received.append(signum)
        with lock:
            for trial in running.values():
                os.killpg(trial.proc.pid, signal.SIGTERM)  # Every worker backs up one step, then stops.

    left = [total - len(done)]  # Trials still to ask for.
    asking = threading.Lock()

    def worker():
        """Asks for a trial and tells its outcome, until the budget is spent. One ask at a time:
        Optuna's SQLite storage can hand two threads the same enqueued trial (seen: both ran
        trial 0), as its `optimize(n_jobs=...)` does."""
        while True:
            with asking:
                if left[0] <= 0 or stopping.is_set():
                    return
                left[0] -= 1
                asked = study.ask()
            try:
                study.tell(asked, objective(asked))
            except optuna.TrialPruned:
                study.tell(asked, state=optuna.trial.TrialState.PRUNED)
            except _TrialFailed:
                study.tell(asked, state=optuna.trial.TrialState.FAIL)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if left[0] > 0:
            board.start(total, len(done))
            workers = [threading.Thread(target=worker, name=f"distrib_tf-sweep-{i}") for i in range(parallel)]
            for thread in workers:
                thread.start()
            for thread in workers:
                while thread.is_alive():  # In short waits: the signal handlers run in this thread.
                    thread.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        board.stop()
    if not stopping.is_set():
        return exit_codes.OK
    if received[:1] == [signal.SIGTERM] and all(code == exit_codes.PREEMPTED for code in codes):
        return exit_codes.PREEMPTED  # A scheduler's notice, every trial backed up: start it again.
    return exit_codes.INTERRUPTED


def _command(after: list[str]) -> tuple[list[str], bool]:
    """The trial's program, and whether it is the main job (nothing, or only its flags, after `--`)."""
    if not after or after[0].startswith("-"):
        return [sys.executable, "-m", "distrib_tf.train", *after], True
    if after[0] in ("python", "python3"):  # The sweep's own interpreter: the one with distrib_tf.
        return [sys.executable, *after[1:]], False
    return after, False


def parse_args(argv: list[str]):
    parser = argparsing.Parser(
        prog="distrib-tf-sweep", description="Sweep the hyperparameters of your script (or the main job's flags); "
        "every trial a distributed run.",
        epilog="Example: distrib-tf-sweep --space='learning_rate=loguniform(1e-4,1e-2) units=[32,64]' "
               "--sampler=tpe --trials=8 --pruner=median -- python my_script.py")
    parser.add_argument("--space", default="", help="NAME=VALUES items: [a,b], linspace(a,b,n), logspace(a,b,n), "
                        "uniform(a,b), loguniform(a,b), int(a,b), logint(a,b); NAME as the script's "
                        "distrib_tf.params(...) declares it (the main job: " + ", ".join(sorted(SWEEPABLE)) + ")")
    parser.add_argument("--space_file", help="the same as a JSON object, merged under --space")
    parser.add_argument("--sampler", default="grid", choices=("grid", "random", "tpe"),
                        help="Optuna's sampler (default: grid, in the order written)")
    parser.add_argument("--trials", type=int, help="how many trials (required for random and tpe; "
                        "caps the grid; default: the whole grid)")
    parser.add_argument("--pruner", default="none", choices=PRUNERS,
                        help="Optuna's pruner, fed each epoch's metric (default: none)")
    parser.add_argument("--pruner_startup_trials", type=int, default=2,
                        help="median: trials that end before any is pruned (default: 2)")
    parser.add_argument("--pruner_warmup_epochs", type=int, default=0,
                        help="median: epochs before a trial can be pruned; halving, hyperband: the "
                             "first rung's epochs (default: 0, i.e. 1)")
    parser.add_argument("--cluster_spec", default="local_2workers",
                        help="the slots: the local tasks of a spec file or a shipped spec's name "
                             "(default: local_2workers)")
    parser.add_argument("--workers_per_trial", type=int,
                        help="workers of each trial, on 127.0.0.1 (default: every task of the spec, "
                             "one trial at a time)")
    parser.add_argument("--parallel", type=int,
                        help="at most this many trials at once (default: as many as the slots hold)")
    parser.add_argument("--sweep_dir", default="runs/sweep", help="trials and results go there (default: runs/sweep)")
    parser.add_argument("--metric", default="val_accuracy", help="the objective: a metric of the run's epochs "
                        "(default: val_accuracy)")
    parser.add_argument("--mode", default="max", choices=("max", "min"), help="whether a larger metric is better")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random and tpe samplers (default: 0)")
    parser.add_argument("command", nargs=argparsing.REMAINDER,
                        help="-- python my_script.py [ARGS] (default: the main job; -- --flag=value: its flags)")
    return parser.parse_args(argv)


def _read_space_file(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read search space {path}: {e}. Expected a JSON object of names.") from e
    if not isinstance(data, dict):
        raise ValueError(f"Invalid search space in {path}. Received: {type(data).__name__}. "
                         "Expected a JSON object of names.")
    return data


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"Invalid value for `{flag}`. Received: {value}. Expected an integer >= 1.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command, main_job = _command(argparsing.command_after(args.command))
    try:
        space = parse_space(args.space, _read_space_file(args.space_file), SWEEPABLE if main_job else None)
        for value, flag in ((args.trials, "--trials"), (args.workers_per_trial, "--workers_per_trial"),
                            (args.parallel, "--parallel")):
            _positive(value, flag)
        if args.sampler != "grid" and args.trials is None:
            raise ValueError(f"Missing `--trials` for --sampler={args.sampler}. Expected a budget >= 1.")
        total = min(grid_size(space), args.trials or math.inf) if args.sampler == "grid" else args.trials
        slots = len(ClusterSpec.load(args.cluster_spec).local_tasks())
        if not slots:
            raise ValueError(f"No task of {args.cluster_spec} lives on this host. Expected a local spec "
                             "for sweep trials, such as local_2workers.")
        per_trial = args.workers_per_trial or slots
        if per_trial > slots:
            raise ValueError(f"Invalid value for `--workers_per_trial`. Received: {per_trial}. Expected at most "
                             f"the {slots} local tasks of {args.cluster_spec}.")
        script = command[1] if not main_job and command[0] == sys.executable and len(command) > 1 else ""
        if script.endswith(".py") and not os.path.exists(script):
            raise ValueError(f"Cannot find the script {script}. Expected -- python PATH/TO/SCRIPT.py.")
        _optuna()
    except ValueError as e:  # ClusterSpecError included.
        print(f"distrib-tf-sweep: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    parallel = min(slots // per_trial, args.parallel or slots)
    where = ([f"--workers={per_trial}"] if args.workers_per_trial and per_trial < slots
             else [f"--cluster_spec={args.cluster_spec}"])
    os.makedirs(args.sweep_dir, exist_ok=True)
    study = open_study(args.sweep_dir, space, sampler=args.sampler, seed=args.seed, mode=args.mode,
                       pruner=args.pruner, startup_trials=args.pruner_startup_trials,
                       warmup_epochs=args.pruner_warmup_epochs)
    program = "the main job" if main_job else shlex.join(argparsing.command_after(args.command))
    print(f"sweep: {args.sampler} over {[d.name for d in space]} of {program}, {total} trial(s), {parallel} at a "
          f"time on {per_trial} of the {slots} slots of {args.cluster_spec} each; pruner {args.pruner}; "
          f"study {args.sweep_dir}/study.db", flush=True)
    sweep = Sweep(space, args.sweep_dir, command, where, args.metric, args.mode, args.pruner != "none")
    board = sweep_results.Board(args.metric, args.mode, sys.stdout)
    sweep.say = board.say
    code = run_sweep(study, sweep, total=total, parallel=parallel, board=board)
    rows = sweep_results.write(study, sweep.sweep_dir, space, metric=args.metric, mode=args.mode)
    if code != exit_codes.OK:
        print("sweep: interrupted; every running trial backed up and stopped. Run the same command to go on.",
              file=sys.stderr)
        return code
    print(sweep_results.format_table(rows, [d.name for d in space], args.metric))
    plot = sweep_results.plot(rows, [d.name for d in space], os.path.join(args.sweep_dir, "sweep.png"),
                              metric=args.metric, mode=args.mode)
    print(f"results: {args.sweep_dir}/results.csv" + (f", {plot}" if plot else ""))
    return exit_codes.FAILED if any(r["status"] == "failed" for r in rows) else exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
