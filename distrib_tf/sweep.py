"""Hyperparameter sweeps whose trials are distributed jobs.

Usage:

    python -m distrib_tf.sweep --space='learning_rate=[1e-3,3e-3] global_batch_size=[32,64]'
        [--space_file=space.json] [--sampler=grid|random|tpe] [--trials=N]
        [--cluster_spec=local_2workers] [--sweep_dir=runs/sweep]
        [--metric=val_accuracy] [--mode=max] [--seed=0] [-- MORE TRAIN FLAGS]

Each trial is a real run of the main job (`distrib_tf.train`) through the launcher on
the cluster spec, in its own `model_dir` (`SWEEP_DIR/trial-<id>`, the id a hash of its
values). Where the machine has room for several trials at once (more CPUs than one
trial has local tasks), they run side by side, each on its own free ports.

Search space, one `NAME=VALUES` per flag of the main job:

- `[a,b,c]`: these values (grid or random choice);
- `linspace(a,b,n)`, `logspace(a,b,n)`: n values from a to b, evenly or on a log scale;
- `uniform(a,b)`, `loguniform(a,b)`: any value (random and tpe samplers only).

A JSON file says the same: `{"learning_rate": {"loguniform": [1e-4, 1e-2]},
"global_batch_size": [32, 64]}`. `--sampler=tpe` uses Optuna's TPE sampler
(`pip install 'distrib_tf[sweep]'`).

Results: `results.csv` and `results.json` (every trial's values, status, final and
best metric, examples per second, wall time, and for a failed trial its root cause),
sorted by the metric; `sweep.png` (the metric against each swept value, and the curves
of the best trials); a table printed at the end. A failed trial is recorded and the
sweep goes on; running the same sweep again skips finished trials and resumes the
others from their backups; Ctrl-C stops every trial and leaves no process behind.
Bad input prints one line and exits with code 2 before anything starts. Exit codes: 0
every trial finished; 1 some failed (and are recorded); 2 bad input; 130 interrupted.

This module imports no TensorFlow.
"""

import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time

from distrib_tf import cli
from distrib_tf import events
from distrib_tf import launch
from distrib_tf.cluster import ClusterSpec

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
SWEEPABLE = {
    "learning_rate": float, "global_batch_size": int, "epochs": int, "steps_per_epoch": int,
    "mixed_precision": str, "seed": int, "model": str, "dataset": str, "cpu_replicas": int,
}
_FORM = re.compile(r"^(linspace|logspace|uniform|loguniform)\((.*)\)$")


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One swept flag: a list of values, or a continuous range."""

    name: str
    values: tuple = ()
    low: float | None = None
    high: float | None = None
    log: bool = False

    @property
    def is_range(self) -> bool:
        return not self.values


def _number(text: str, name: str, kind=float):
    try:
        return kind(text)
    except ValueError as e:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected {'an integer' if kind is int else 'a number'}.") from e


def parse_dimension(name: str, spec) -> Dimension:
    """Parses one flag's values from text (`[..]`, `linspace(..)`, ...) or JSON."""
    if name not in SWEEPABLE:
        raise ValueError(f"Invalid flag `{name}` in the search space. Expected one of "
                         f"{', '.join(sorted(SWEEPABLE))}.")
    kind = SWEEPABLE[name]
    if isinstance(spec, dict) and len(spec) == 1:
        (form, args), = spec.items()
        spec = f"{form}({','.join(map(str, args))})" if isinstance(args, list) else None
    if isinstance(spec, list):
        spec = "[" + ",".join(map(str, spec)) + "]"
    if not isinstance(spec, str):
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {spec!r}. "
                         "Expected a list, or one of linspace, logspace, uniform, loguniform.")
    text = spec.strip()
    if text.startswith("[") and text.endswith("]"):
        items = [t.strip() for t in text[1:-1].split(",") if t.strip()]
        if not items:
            raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                             "Expected at least one value, such as [1e-3,3e-3].")
        return Dimension(name, tuple(kind(i) if kind is str else _number(i, name, kind) for i in items))
    form = _FORM.match(text)
    if not form or kind is str:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         "Expected [a,b,...], linspace(a,b,n), logspace(a,b,n), uniform(a,b) "
                         "or loguniform(a,b).")
    args = [a.strip() for a in form.group(2).split(",")]
    is_grid = form.group(1) in ("linspace", "logspace")
    if len(args) != (3 if is_grid else 2):
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected {form.group(1)}({'a,b,n' if is_grid else 'a,b'}).")
    low, high = _number(args[0], name), _number(args[1], name)
    log = form.group(1).startswith("log")
    if not low < high or (log and low <= 0):
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected a < b{' and a > 0 on a log scale' if log else ''}.")
    if not is_grid:
        return Dimension(name, low=low, high=high, log=log)
    count = _number(args[2], name, int)
    if count < 2:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         "Expected n >= 2.")
    points = [math.exp(math.log(low) + i * (math.log(high) - math.log(low)) / (count - 1)) if log
              else low + i * (high - low) / (count - 1) for i in range(count)]
    return Dimension(name, tuple(kind(round(p, 12)) if kind is int else p for p in points))


def parse_space(text: str = "", data: dict | None = None) -> list[Dimension]:
    """The search space from `NAME=VALUES ...` text and/or a JSON object."""
    dimensions = {}
    for name, spec in (data or {}).items():
        dimensions[name] = parse_dimension(name, spec)
    for item in re.findall(r"(\S+?)=(\[[^\]]*\]|\w+\([^)]*\)|\S+)", text or ""):
        dimensions[item[0]] = parse_dimension(*item)
    leftover = re.sub(r"(\S+?)=(\[[^\]]*\]|\w+\([^)]*\)|\S+)", "", text or "").strip()
    if leftover:
        raise ValueError(f"Invalid value for `--space`. Received: {leftover!r}. Expected "
                         "NAME=VALUES items, such as learning_rate=[1e-3,3e-3].")
    if not dimensions:
        raise ValueError("Empty search space. Expected --space='NAME=VALUES ...' or --space_file.")
    return list(dimensions.values())


def sample_trials(space: list[Dimension], *, sampler: str, trials: int | None, seed: int) -> list[dict]:
    """The trials' values: the whole grid (capped at `trials`), or `trials` random draws."""
    if sampler == "grid":
        ranges = [d.name for d in space if d.is_range]
        if ranges:
            raise ValueError(f"Invalid search space for --sampler=grid: {', '.join(ranges)} "
                             "is a continuous range. Expected lists or linspace/logspace, or "
                             "--sampler=random.")
        grid = [dict(zip([d.name for d in space], values))
                for values in itertools.product(*(d.values for d in space))]
        return grid[:trials] if trials else grid
    rng = random.Random(seed)

    def draw(d: Dimension):
        if not d.is_range:
            return rng.choice(d.values)
        if d.log:
            return math.exp(rng.uniform(math.log(d.low), math.log(d.high)))
        return rng.uniform(d.low, d.high)

    return [{d.name: draw(d) for d in space} for _ in range(trials)]


def trial_id(values: dict) -> str:
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]


@dataclasses.dataclass
class Trial:
    values: dict
    model_dir: str
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
    summary_path = os.path.join(trial.model_dir, "summary.json")
    if code == 0 and os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            trial.summary = json.load(f)
        trial.status = "finished"
    else:
        trial.status, trial.cause = "failed", _root_cause(trial.model_dir)


def run_sweep(trials: list[Trial], *, cluster_spec: str, extra: list[str], parallel: int,
              say=print) -> list[Trial]:
    """Runs the trials, `parallel` at a time; a finished trial (its summary exists) is skipped."""
    pending = []
    for trial in trials:
        if os.path.exists(os.path.join(trial.model_dir, "summary.json")):
            with open(os.path.join(trial.model_dir, "summary.json"), encoding="utf-8") as f:
                trial.summary, trial.status = json.load(f), "finished"
            say(f"trial {trial.id} {trial.values}: finished before, skipped")
        else:
            pending.append(trial)
    running: list[Trial] = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                trial = pending.pop(0)
                resumed = os.path.isdir(os.path.join(trial.model_dir, "backup"))
                _start(trial, cluster_spec=cluster_spec, extra=extra)
                say(f"trial {trial.id} {trial.values}: {'resumed' if resumed else 'started'}")
                running.append(trial)
            for trial in [t for t in running if t.proc.poll() is not None]:
                _finish(trial)
                running.remove(trial)
                say(f"trial {trial.id}: {trial.status} in {trial.seconds:.0f} s"
                    + (f" ({trial.cause})" if trial.cause else ""))
            time.sleep(0.2)
    except KeyboardInterrupt:
        for trial in running:
            os.killpg(trial.proc.pid, signal.SIGINT)  # The launcher stops its tasks.
        for trial in running:
            try:
                trial.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(trial.proc.pid, signal.SIGKILL)
                trial.proc.wait()
            trial.status = "interrupted"
        raise
    return trials


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


def _tpe_trials(space, *, trials, seed, mode, evaluate):
    try:
        import optuna  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ValueError("Invalid value for `--sampler`. Received: 'tpe' without Optuna. "
                         "Expected it installed: pip install 'distrib_tf[sweep]'.") from e
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize" if mode == "max" else "minimize",
                                sampler=optuna.samplers.TPESampler(seed=seed))
    for _ in range(trials):
        ask = study.ask()
        values = {}
        for d in space:
            if d.is_range:
                values[d.name] = ask.suggest_float(d.name, d.low, d.high, log=d.log)
            else:
                values[d.name] = ask.suggest_categorical(d.name, list(d.values))
        value = evaluate(values)  # None for a failed trial; 0.0 is a metric like any other.
        study.tell(ask, value, state=optuna.trial.TrialState.FAIL if value is None else None)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="distrib-tf-sweep", description="Sweep the main job's flags.")
    parser.add_argument("--space", default="", help="NAME=VALUES items: [a,b], linspace(a,b,n), "
                        "logspace(a,b,n), uniform(a,b), loguniform(a,b); flags: " + ", ".join(sorted(SWEEPABLE)))
    parser.add_argument("--space_file", help="the same as a JSON object, merged under --space")
    parser.add_argument("--sampler", default="grid", help="grid, random or tpe (Optuna's)")
    parser.add_argument("--trials", type=int, help="how many trials (required for random and tpe; "
                        "caps the grid; default: the whole grid)")
    parser.add_argument("--cluster_spec", default="local_2workers",
                        help="where each trial runs: a local spec file or a shipped spec's name")
    parser.add_argument("--sweep_dir", default="runs/sweep", help="trials and results go there")
    parser.add_argument("--metric", default="val_accuracy", help="a metric of the main job's epochs")
    parser.add_argument("--mode", default="max", help="max or min: whether a larger metric is better")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random and tpe samplers")
    parser.add_argument("--parallel", type=int, help="trials at once (default: what the CPUs allow)")
    parser.add_argument("extra", nargs=cli.REMAINDER, help="-- more flags for every trial's main job")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    extra = cli.command_after(args.extra)
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
        if args.sampler not in ("grid", "random", "tpe"):
            raise ValueError(f"Invalid value for `--sampler`. Received: {args.sampler!r}. "
                             "Expected grid, random or tpe.")
        if args.trials is not None and args.trials < 1:
            raise ValueError(f"Invalid value for `--trials`. Received: {args.trials}. Expected an integer >= 1.")
        if args.sampler != "grid" and args.trials is None:
            raise ValueError(f"Missing `--trials` for --sampler={args.sampler}. Expected a budget >= 1.")
        if args.mode not in ("max", "min"):
            raise ValueError(f"Invalid value for `--mode`. Received: {args.mode!r}. Expected max or min.")
        spec = ClusterSpec.load(args.cluster_spec)
        needed = max(len(spec.local_tasks()), 1)
        if not spec.local_tasks():
            raise ValueError(f"No task of {args.cluster_spec} lives on this host. Expected a local spec "
                             "for sweep trials, such as local_2workers.")
        planned = [] if args.sampler == "tpe" else sample_trials(
            space, sampler=args.sampler, trials=args.trials, seed=args.seed)
    except ValueError as e:  # ClusterSpecError included.
        print(f"distrib-tf-sweep: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    os.makedirs(args.sweep_dir, exist_ok=True)
    parallel = args.parallel or max(1, (os.cpu_count() or 1) // needed)
    print(f"sweep: {args.sampler} over {[d.name for d in space]}, "
          f"{len(planned) if planned else args.trials} trial(s), {parallel} at a time, "
          f"each on {needed} local task(s) of {args.cluster_spec}", flush=True)

    def trial_for(values):
        return Trial(values, os.path.join(args.sweep_dir, f"trial-{trial_id(values)}"))

    say = lambda text: print(text, flush=True)  # noqa: E731
    try:
        if args.sampler == "tpe":
            trials = []

            def evaluate(values):
                trial = trial_for(values)
                trials.append(trial)
                run_sweep([trial], cluster_spec=args.cluster_spec, extra=extra, parallel=1, say=say)
                return _row(trial, args.metric, args.mode)[f"best_{args.metric}"]

            try:
                _tpe_trials(space, trials=args.trials, seed=args.seed, mode=args.mode, evaluate=evaluate)
            except ValueError as e:
                print(f"distrib-tf-sweep: error: {e}", file=sys.stderr)
                return EXIT_USAGE
        else:
            trials = run_sweep([trial_for(v) for v in planned], cluster_spec=args.cluster_spec,
                               extra=extra, parallel=parallel, say=say)
    except KeyboardInterrupt:
        print("sweep: interrupted; every trial stopped. Run the same command to resume.", file=sys.stderr)
        return EXIT_INTERRUPTED
    rows = write_results(trials, args.sweep_dir, metric=args.metric, mode=args.mode)
    names = [d.name for d in space]
    plot = plot_sweep(rows, trials, names, os.path.join(args.sweep_dir, "sweep.png"), metric=args.metric)
    print(format_table(rows, names, args.metric))
    print(f"results: {args.sweep_dir}/results.csv, results.json" + (f", {plot}" if plot else ""))
    return EXIT_OK if all(t.status == "finished" for t in trials) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
