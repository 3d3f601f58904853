"""Hyperparameter sweeps whose trials are distributed jobs.

Usage:

    python -m distrib_tf.experiments.sweep --space='learning_rate=[1e-3,3e-3] global_batch_size=[32,64]'
        [--space_file=space.json] [--sampler=grid|random|tpe] [--trials=N]
        [--cluster_spec=local_2workers] [--sweep_dir=runs/sweep]
        [--metric=val_accuracy] [--mode=max] [--seed=0] [-- MORE TRAIN FLAGS]

Each trial is a real run of the main job (`distrib_tf.train`) through the launcher on
the cluster spec, in its own `model_dir` (`SWEEP_DIR/trial-<id>`, the id a hash of its
values). Where the machine has room for several trials at once (more CPUs than one
trial has local tasks), they run side by side, each on its own free ports.

The search space (`distrib_tf.experiments.sweep_space`): `[a,b]`, `linspace(a,b,n)`,
`logspace(a,b,n)`, `uniform(a,b)`, `loguniform(a,b)` per flag, or a JSON file.

Built on Optuna (`pip install 'distrib_tf[sweep]'`): its grid, random and TPE samplers
choose the values, and its study in `SWEEP_DIR/study.db` (SQLite) records every trial
with its best metric (`--mode=max|min`; 0.0 is a metric like any other) or its failure
(the launcher's root cause, from the trial's event stream, as the trial's `cause`).
What Optuna does not do is here: each trial is a distributed job; running the same sweep
again keeps its finished trials, runs its failed or interrupted ones again (resumed
from their backups) and then new ones up to the budget; Ctrl-C stops every trial and
leaves no process behind. Results: `results.csv` and `results.json` (values, status,
final and best metric, examples per second, wall time, root cause), sorted by the
metric; `sweep.png` (the metric against each swept value, and the curves of the best
trials); a table printed at the end.
Bad input prints one line and exits with code 2 before anything starts. Exit codes: 0
every trial finished; 1 some failed (and are recorded); 2 bad input; 130 interrupted.

This module imports no TensorFlow.
"""

import csv
import dataclasses
import hashlib
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
from distrib_tf import launch
from distrib_tf.cluster import ClusterSpec
from distrib_tf.experiments.sweep_space import SWEEPABLE
from distrib_tf.experiments.sweep_space import Dimension
from distrib_tf.experiments.sweep_space import grid_size
from distrib_tf.experiments.sweep_space import parse_space
from distrib_tf.experiments.sweep_space import suggest


def _optuna():
    try:
        import optuna  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ValueError("Missing Optuna, which sweeps are built on. Expected it installed: "
                         "pip install 'distrib_tf[sweep]'.") from e
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # The sweep says what each trial did.
    return optuna


def open_study(sweep_dir: str, space: list[Dimension], *, sampler: str, seed: int, mode: str):
    """The sweep's Optuna study, in `sweep_dir/study.db` (SQLite): created, or loaded to resume."""
    optuna = _optuna()
    class Grid(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values):
            """Never stops the study: the sweep's budget counts the failed trials it retries."""

    samplers = {"grid": lambda: Grid({d.name: list(d.values) for d in space}, seed=seed),
                "random": lambda: optuna.samplers.RandomSampler(seed=seed),
                "tpe": lambda: optuna.samplers.TPESampler(seed=seed)}
    storage = "sqlite:///" + os.path.abspath(os.path.join(sweep_dir, "study.db"))
    return optuna.create_study(study_name="distrib_tf", storage=storage, load_if_exists=True,
                               sampler=samplers[sampler](), direction="maximize" if mode == "max" else "minimize")


def trial_id(values: dict) -> str:
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]


@dataclasses.dataclass
class Trial:
    values: dict
    model_dir: str
    asked: object = None  # The Optuna trial, while it runs.
    status: str = "pending"
    cause: str = ""
    summary: dict | None = None
    seconds: float = 0.0
    proc: subprocess.Popen | None = None
    started: float = 0.0
    log: object = None

    @property
    def id(self) -> str:
        return trial_id(self.values)


def _flags(values: dict) -> list[str]:
    return [f"--{name}={value}" for name, value in values.items()]


def _start(trial: Trial, *, cluster_spec: str, extra: list[str]):
    os.makedirs(trial.model_dir, exist_ok=True)
    trial.log = open(os.path.join(trial.model_dir, "trial.log"), "a", encoding="utf-8")
    command = launch.command_line(
        cluster_spec, launch.main_job_command(trial.model_dir, [*extra, *_flags(trial.values)]),
        grace_period=5, events=os.path.join(trial.model_dir, "events.jsonl"))
    trial.log.write(f"$ {shlex.join(command)}\n")
    trial.log.flush()
    trial.proc = subprocess.Popen(command, stdout=trial.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    trial.started, trial.status = time.monotonic(), "running"


def _root_cause(model_dir: str) -> str:
    """The launcher's root cause from the trial's event stream (`distrib_tf.events`)."""
    ends = [e for e in events.read(os.path.join(model_dir, "events.jsonl")) if e["event"] == "job_end"]
    if ends and ends[-1].get("root_cause"):
        return ends[-1]["root_cause"][:300]
    with open(os.path.join(model_dir, "trial.log"), encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"  # Bad input: the launcher's one line.


def _finish(trial: Trial):
    code = trial.proc.wait()
    trial.log.close()
    trial.seconds = time.monotonic() - trial.started
    trial.summary = _read_summary(trial.model_dir) if code == 0 else None
    if trial.summary is not None:
        trial.status = "finished"
    else:
        trial.status, trial.cause = "failed", _root_cause(trial.model_dir)


class _TrialFailed(Exception):
    """A trial that ended without its metric: Optuna records it as failed."""


def run_sweep(study, space: list[Dimension], *, total: int, sweep_dir: str, cluster_spec: str,
              extra: list[str], parallel: int, metric: str, mode: str, say=print) -> list[Trial]:
    """Runs `study` up to `total` trials, `parallel` at a time, each a distributed job.

    A study resumed from its storage keeps its finished trials; its failed or interrupted
    ones run again first (resumed from their backups), then new ones fill the budget.
    Optuna's `optimize` runs each trial in a thread that waits for its launcher, and is
    told the trial's best `metric`, or that it failed (the root cause kept as `cause`).

    Raises:
        KeyboardInterrupt: on Ctrl-C, once every running trial has stopped.
    """
    optuna = _optuna()
    trials, retry = [], []
    for old in study.get_trials(deepcopy=False):
        values = {d.name: old.params[d.name] for d in space if d.name in old.params}
        if old.state == optuna.trial.TrialState.COMPLETE:
            trial = Trial(values, _trial_dir(sweep_dir, values), status="finished")
            trial.summary = _read_summary(trial.model_dir)
            trials.append(trial)
            say(f"trial {trial.id} {values}: finished before, skipped")
        elif len(values) == len(space) and values not in retry:  # Failed, or its sweep was killed.
            retry.append(values)
    for values in retry:
        if values not in [t.values for t in trials]:
            study.enqueue_trial(values)
    running: dict[int, Trial] = {}
    lock, stopping = threading.RLock(), threading.Event()

    def objective(asked):
        values = suggest(asked, space)
        trial = Trial(values, _trial_dir(sweep_dir, values), asked)
        resumed = os.path.isdir(os.path.join(trial.model_dir, "backup"))
        with lock:
            if stopping.is_set():
                study.stop()
                raise _TrialFailed("the sweep was interrupted")
            _start(trial, cluster_spec=cluster_spec, extra=extra)
            running[asked.number] = trial
        say(f"trial {trial.id} {values}: {'resumed' if resumed else 'started'}")
        trial.proc.wait()
        with lock:
            del running[asked.number]
            _finish(trial)
            trials.append(trial)
        if stopping.is_set():
            trial.status = "interrupted"
            study.stop()
            raise _TrialFailed("the sweep was interrupted")
        say(f"trial {trial.id}: {trial.status} in {trial.seconds:.0f} s" + (f" ({trial.cause})" if trial.cause else ""))
        value = _row(trial, metric, mode)[f"best_{metric}"]
        if trial.status == "finished" and value is not None:  # 0.0 is a metric like any other.
            return value
        asked.set_user_attr("cause", trial.cause or f"no {metric} in its summary")
        raise _TrialFailed(trial.cause)

    def interrupt(signum, frame):
        stopping.set()
        with lock:
            for trial in running.values():
                os.killpg(trial.proc.pid, signal.SIGINT)  # The launcher stops its tasks.

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        if total > len(trials):
            study.optimize(objective, n_trials=total - len(trials), n_jobs=parallel, catch=(_TrialFailed,))
    finally:
        signal.signal(signal.SIGINT, previous)
    if stopping.is_set():
        raise KeyboardInterrupt
    return trials


def _trial_dir(sweep_dir: str, values: dict) -> str:
    return os.path.join(sweep_dir, f"trial-{trial_id(values)}")


def _read_summary(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _row(trial: Trial, metric: str, mode: str) -> dict:
    summary = trial.summary or {}
    history = [e[metric] for e in summary.get("epochs", []) if metric in e]
    best = (max if mode == "max" else min)(history) if history else None
    final = summary.get("final", {})
    final_metric = final.get(metric.removeprefix("val_"), history[-1] if history else None)
    return {"trial": trial.id, **trial.values, "status": trial.status,
            f"final_{metric}": final_metric, f"best_{metric}": best,
            "examples_per_second": summary.get("examples_per_second"),
            "wall_seconds": summary.get("wall_seconds", trial.seconds or None),
            "cause": trial.cause, "model_dir": trial.model_dir}


def write_results(trials: list[Trial], sweep_dir: str, *, metric: str, mode: str) -> list[dict]:
    rows = [_row(t, metric, mode) for t in trials]
    sign = -1 if mode == "max" else 1
    rows.sort(key=lambda r: (r[f"best_{metric}"] is None, sign * (r[f"best_{metric}"] or 0)))
    with open(os.path.join(sweep_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(sweep_dir, "results.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def plot_sweep(rows: list[dict], trials: list[Trial], names: list[str], path: str, *, metric: str, best: int = 3):
    """The metric against each swept value, and the curves of the best trials."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    done = [r for r in rows if r[f"best_{metric}"] is not None]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4 * (len(names) + 1), 3.5))
    for ax, name in zip(axes, names):
        ax.scatter([r[name] for r in done], [r[f"best_{metric}"] for r in done])
        if all(isinstance(r[name], (int, float)) and r[name] > 0 for r in done) and \
                len({r[name] for r in done}) > 1 and max(r[name] for r in done) / min(r[name] for r in done) > 20:
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel(f"best {metric}")
    by_id = {t.id: t for t in trials}
    for r in done[:best]:
        epochs = by_id[r["trial"]].summary["epochs"]
        axes[-1].plot([e["epoch"] for e in epochs], [e.get(metric) for e in epochs], "-o",
                      label=", ".join(f"{n}={r[n]:.3g}" if isinstance(r[n], float) else f"{n}={r[n]}"
                                      for n in names))
    axes[-1].set_xlabel("epoch")
    axes[-1].set_ylabel(metric)
    axes[-1].set_title(f"best {min(best, len(done))} trials")
    if done:
        axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def format_table(rows: list[dict], names: list[str], metric: str) -> str:
    header = ["trial", *names, "status", f"best_{metric}", "examples/s", "seconds"]
    lines = [" | ".join(header)]
    for r in rows:
        cells = [r["trial"], *[f"{r[n]:.4g}" if isinstance(r[n], float) else str(r[n]) for n in names],
                 r["status"], "-" if r[f"best_{metric}"] is None else f"{r[f'best_{metric}']:.4f}",
                 "-" if r["examples_per_second"] is None else f"{r['examples_per_second']:.0f}",
                 "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}"]
        lines.append(" | ".join(cells) + (f"  ({r['cause']})" if r["cause"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparsing.Parser(prog="distrib-tf-sweep", description="Sweep the main job's flags.")
    parser.add_argument("--space", default="", help="NAME=VALUES items: [a,b], linspace(a,b,n), "
                        "logspace(a,b,n), uniform(a,b), loguniform(a,b); flags: " + ", ".join(sorted(SWEEPABLE)))
    parser.add_argument("--space_file", help="the same as a JSON object, merged under --space")
    parser.add_argument("--sampler", default="grid", choices=("grid", "random", "tpe"), help="Optuna's sampler")
    parser.add_argument("--trials", type=int, help="how many trials (required for random and tpe; "
                        "caps the grid; default: the whole grid)")
    parser.add_argument("--cluster_spec", default="local_2workers",
                        help="where each trial runs: a local spec file or a shipped spec's name")
    parser.add_argument("--sweep_dir", default="runs/sweep", help="trials and results go there")
    parser.add_argument("--metric", default="val_accuracy", help="a metric of the main job's epochs")
    parser.add_argument("--mode", default="max", choices=("max", "min"), help="whether a larger metric is better")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random and tpe samplers")
    parser.add_argument("--parallel", type=int, help="trials at once (default: what the CPUs allow)")
    parser.add_argument("extra", nargs=argparsing.REMAINDER, help="-- more flags for every trial's main job")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    extra = argparsing.command_after(args.extra)
    try:
        data = None
        if args.space_file:
            try:
                with open(args.space_file, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"Cannot read search space {args.space_file}: {e}. "
                                 "Expected a JSON object of flag names.") from e
            if not isinstance(data, dict):
                raise ValueError(f"Invalid search space in {args.space_file}. Received: "
                                 f"{type(data).__name__}. Expected a JSON object of flag names.")
        space = parse_space(args.space, data)
        if args.trials is not None and args.trials < 1:
            raise ValueError(f"Invalid value for `--trials`. Received: {args.trials}. Expected an integer >= 1.")
        if args.sampler != "grid" and args.trials is None:
            raise ValueError(f"Missing `--trials` for --sampler={args.sampler}. Expected a budget >= 1.")
        total = min(grid_size(space), args.trials or math.inf) if args.sampler == "grid" else args.trials
        spec = ClusterSpec.load(args.cluster_spec)
        needed = max(len(spec.local_tasks()), 1)
        if not spec.local_tasks():
            raise ValueError(f"No task of {args.cluster_spec} lives on this host. Expected a local spec "
                             "for sweep trials, such as local_2workers.")
        _optuna()
    except ValueError as e:  # ClusterSpecError included.
        print(f"distrib-tf-sweep: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    os.makedirs(args.sweep_dir, exist_ok=True)
    study = open_study(args.sweep_dir, space, sampler=args.sampler, seed=args.seed, mode=args.mode)
    parallel = args.parallel or max(1, (os.cpu_count() or 1) // needed)
    print(f"sweep: {args.sampler} over {[d.name for d in space]}, {total} trial(s), {parallel} at a "
          f"time, each on {needed} local task(s) of {args.cluster_spec}; study {args.sweep_dir}/study.db",
          flush=True)
    try:
        trials = run_sweep(study, space, total=total, sweep_dir=args.sweep_dir, cluster_spec=args.cluster_spec,
                           extra=extra, parallel=parallel, metric=args.metric, mode=args.mode,
                           say=lambda text: print(text, flush=True))
    except KeyboardInterrupt:
        print("sweep: interrupted; every trial stopped. Run the same command to resume.", file=sys.stderr)
        return exit_codes.INTERRUPTED
    rows = write_results(trials, args.sweep_dir, metric=args.metric, mode=args.mode)
    names = [d.name for d in space]
    plot = plot_sweep(rows, trials, names, os.path.join(args.sweep_dir, "sweep.png"), metric=args.metric)
    print(format_table(rows, names, args.metric))
    print(f"results: {args.sweep_dir}/results.csv, results.json" + (f", {plot}" if plot else ""))
    return exit_codes.OK if all(t.status == "finished" for t in trials) else exit_codes.FAILED


if __name__ == "__main__":
    sys.exit(main())
