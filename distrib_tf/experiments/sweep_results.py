"""What a person looks at during and after a sweep: a live line, `results.csv`, `sweep.png`.

Every figure comes from the study (Optuna's record of each trial) and from each trial's
own event stream (`SWEEP_DIR/trial-<id>/events.jsonl`: the `epoch` events of its chief),
which outlives the sweep's process: a sweep started again shows the curves of every trial.

This module imports no TensorFlow.
"""

import csv
import hashlib
import json
import os
import sys
import threading
import time

from distrib_tf import events

CHIEFS = ("chief:0", "worker:0")  # The task whose epoch events are the run's.


def trial_id(values: dict) -> str:
    """A trial's directory name: a digest of its values. Pure."""
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]


def best(curve: dict, mode: str):
    """The best value of an epoch -> metric curve, or None. Pure."""
    return (max if mode == "max" else min)(curve.values()) if curve else None


def step_of(steps: dict, event: dict) -> tuple[int, bool]:
    """The sweep's step of an `epoch` event, and whether it is new: its (fit, epoch) numbered in
    the order first seen, so that a script's second `fit`, whose epochs count from 1 again,
    goes on where the first ended (`steps` holds the numbering so far). Pure but for `steps`."""
    key = (event.get("fit", 1), event["epoch"])
    if key in steps:
        return steps[key], False
    steps[key] = len(steps) + 1
    return steps[key], True


def curve_of(model_dir: str, metric: str) -> dict:
    """Step (`step_of`: the epochs of every fit in turn) -> `metric`, as the run's chief
    reported them (an epoch run again: its last value)."""
    curve, steps = {}, {}
    for event in events.read(os.path.join(model_dir, "events.jsonl")):
        if event["event"] == "epoch" and event.get("task") in CHIEFS and metric in event.get("metrics", {}):
            curve[step_of(steps, event)[0]] = event["metrics"][metric]
    return dict(sorted(curve.items()))


def _summary(model_dir: str) -> dict:
    try:
        with open(os.path.join(model_dir, "summary.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


_STATUS = {"COMPLETE": "finished", "PRUNED": "pruned", "RUNNING": "running"}


def rows_of(study, sweep_dir: str, names: list[str], *, metric: str, mode: str) -> list[dict]:
    """A row per trial directory (the latest Optuna trial of those values), best first."""
    latest = {}
    for t in study.get_trials(deepcopy=False):
        if t.params and t.state.name != "WAITING" and "same_as" not in t.user_attrs:
            latest[trial_id(t.params)] = t
    rows = []
    for key, t in latest.items():
        model_dir = os.path.join(sweep_dir, f"trial-{key}")
        curve, summary = curve_of(model_dir, metric), _summary(model_dir)
        status = _STATUS.get(t.state.name) or ("failed" if "cause" in t.user_attrs else "interrupted")
        final = list(curve.values())[-1] if curve else None
        rows.append({"trial": t.number, "id": key, **{n: t.params.get(n) for n in names}, "status": status,
                     f"best_{metric}": best(curve, mode), f"final_{metric}": final,
                     "epochs": len(curve), "examples_per_second": summary.get("examples_per_second"),
                     "wall_seconds": None if t.datetime_complete is None or t.datetime_start is None
                     else (t.datetime_complete - t.datetime_start).total_seconds(),
                     "cause": t.user_attrs.get("cause", ""), "model_dir": model_dir, "curve": curve})
    sign = -1 if mode == "max" else 1
    rows.sort(key=lambda r: (r["status"] != "finished", r[f"best_{metric}"] is None,
                             sign * (r[f"best_{metric}"] or 0), r["trial"]))
    return rows


def write(study, sweep_dir: str, space, *, metric: str, mode: str) -> list[dict]:
    """`results.csv` (a row per trial, best finished first), and its rows with their curves."""
    rows = rows_of(study, sweep_dir, [d.name for d in space], metric=metric, mode=mode)
    if rows:
        with open(os.path.join(sweep_dir, "results.csv"), "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "curve"], extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    return rows


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def format_table(rows: list[dict], names: list[str], metric: str) -> str:
    header = ["trial", *names, "status", "epochs", f"best_{metric}", "examples/s", "seconds"]
    lines = [" | ".join(header)]
    for r in rows:
        cells = [str(r["trial"]), *[_number(r[n]) for n in names], r["status"], str(r["epochs"]),
                 "-" if r[f"best_{metric}"] is None else f"{r[f'best_{metric}']:.4f}",
                 "-" if r["examples_per_second"] is None else f"{r['examples_per_second']:.0f}",
                 "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}"]
        lines.append(" | ".join(cells) + (f"  ({r['cause']})" if r["cause"] else ""))
    return "\n".join(lines)


def plot(rows: list[dict], names: list[str], path: str, *, metric: str, mode: str):
    """`sweep.png`: the optimization history, every trial's learning curve (pruned ones
    dashed, a cross where they stopped), and the objective against each parameter."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
        import matplotlib.ticker  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    columns = max(2, len(names))
    fig, axes = plt.subplots(2, columns, figsize=(4.2 * columns, 7), squeeze=False)
    for ax in axes[0][2:]:
        ax.set_visible(False)
    ordered = sorted((r for r in rows if r[f"best_{metric}"] is not None), key=lambda r: r["trial"])
    history, curves = axes[0][0], axes[0][1]
    pick = max if mode == "max" else min
    so_far = []
    for r in ordered:
        marker = {"finished": "o", "pruned": "x"}.get(r["status"], "s")
        history.scatter([r["trial"]], [r[f"best_{metric}"]], marker=marker,
                        color="tab:blue" if r["status"] == "finished" else "tab:gray")
        if r["status"] == "finished":
            so_far.append((r["trial"], pick([v for _, v in so_far] + [r[f"best_{metric}"]])))
    if so_far:
        so_far.append((ordered[-1]["trial"], so_far[-1][1]))  # The line runs to the last trial.
        history.step([t for t, _ in so_far], [v for _, v in so_far], where="post", color="tab:red",
                     label=f"best so far ({mode})")
        history.legend(fontsize=7)
    history.set(title="optimization history (x: pruned)", xlabel="trial", ylabel=f"best {metric}")
    history.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    curves.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for r in ordered:
        epochs, values = list(r["curve"]), list(r["curve"].values())
        pruned = r["status"] == "pruned"
        curves.plot(epochs, values, "--" if pruned else "-o", color="tab:gray" if pruned else None, markersize=3,
                    label=None if pruned else f"trial {r['trial']}")
        if pruned:
            curves.plot(epochs[-1:], values[-1:], "x", color="tab:red", markersize=8)
    curves.set(title="learning curves (dashed, x: pruned)", xlabel="epoch", ylabel=metric)
    if any(r["status"] != "pruned" for r in ordered):
        curves.legend(fontsize=7)
    for ax, name in zip(axes[1], names):
        for r in ordered:
            ax.scatter([r[name]], [r[f"best_{metric}"]], marker="x" if r["status"] == "pruned" else "o",
                       color="tab:gray" if r["status"] == "pruned" else "tab:blue")
        values = [r[name] for r in ordered if isinstance(r[name], (int, float))]
        if values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_xscale("log")
        ax.set(xlabel=name, ylabel=f"best {metric}")
    for ax in axes[1][len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Board:
    """The sweep's console: a line per event that matters, and a live line (trials ended,
    pruned and failed, the best so far, where each running trial is), redrawn in place
    on a terminal and printed every `plain_every` seconds elsewhere."""

    def __init__(self, metric: str, mode: str, out=sys.stdout, *, plain_every: float = 30.0):
        self.metric, self.mode, self._out = metric, mode, out
        self._tty, self._every = out.isatty(), (1.0 if out.isatty() else plain_every)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self.total = self.done = self.pruned = self.failed = 0
        self.best, self.best_trial = None, None
        self._running: dict = {}
        self._shown = ""

    def start(self, total: int, done: int) -> None:
        self.total, self.done = total, done
        threading.Thread(target=self._tick, name="distrib_tf-sweep-board", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.say(None)

    def say(self, text: str | None) -> None:
        with self._lock:
            if self._tty and self._shown:
                self._out.write("\r\x1b[K")
                self._shown = ""
            if text is not None:
                self._out.write(text + "\n")
            self._out.flush()

    def started(self, trial, resumed: bool) -> None:
        self._running[trial.number] = trial
        self.say(f"trial {trial.number} {trial.values}: {'resumed' if resumed else 'started'} in {trial.model_dir}")

    def followed(self, trial) -> None:
        """A trial whose job an earlier sweep submitted, followed again on its engine."""
        self._running[trial.number] = trial
        self.say(f"trial {trial.number} {trial.values}: its job {trial.job} followed again in {trial.model_dir}")

    def promoted(self, trial) -> None:
        """A paused trial promoted (`sweep_promotion`): one more attempt to end."""
        self._running[trial.number] = trial
        self.total += 1
        self.say(f"trial {trial.number} {trial.values}: promoted, resumes from its backup after {trial.promoted} "
                 f"epoch(s) in {trial.model_dir}")

    def epoch(self, trial, epoch: int, value: float, *, fit: int = 1) -> None:
        which = f"fit {fit} " if fit > 1 else ""
        self.say(f"trial {trial.number} {which}epoch {epoch}/{trial.epochs or '?'}: {self.metric} {value:.4f}")

    def ended(self, trial, seconds: float) -> None:
        self._running.pop(trial.number, None)
        value = best(trial.curve, self.mode)
        if trial.status in ("finished", "pruned", "failed"):
            self.done += 1
        self.pruned += trial.status == "pruned"
        self.failed += trial.status == "failed"
        if trial.status == "finished" and value is not None and (
                self.best is None or (value > self.best if self.mode == "max" else value < self.best)):
            self.best, self.best_trial = value, trial.number
        fit, epoch = getattr(trial, "at", (1, max(trial.curve, default=0)))
        what = {"finished": f"finished, best {self.metric} {value if value is None else round(value, 4)}",
                "pruned": f"{'paused' if getattr(trial, 'paused', False) else 'pruned'} after "
                          f"{f'fit {fit} ' if fit > 1 else ''}epoch {epoch}",
                "failed": f"failed ({trial.cause})",
                "interrupted": "interrupted (backed up; the same command resumes it)"}
        self.say(f"trial {trial.number}: {what[trial.status]} in {seconds:.0f} s")
        self.say(self.line())

    def line(self) -> str:
        """The live line. Pure of the board's state."""
        parts = [f"sweep: {self.done}/{self.total} ended ({self.pruned} pruned, {self.failed} failed)"]
        if self.best is not None:
            parts.append(f"best {self.metric} {self.best:.4f} (trial {self.best_trial})")
        parts += [f"trial {n} {t.step or 'starting'}" for n, t in sorted(self._running.items())]
        return " · ".join(parts)

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.5):
            if time.monotonic() - last < self._every or not self._running:
                continue
            last = time.monotonic()
            with self._lock:
                text = self.line()
                if self._tty:
                    self._out.write("\r\x1b[K" + text[:200])
                    self._shown = text
                else:
                    self._out.write(text + "\n")
                self._out.flush()
