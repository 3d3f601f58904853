"""`make bench-sync`: communicating less on slow links, to a target test accuracy.

    python benchmarks/sync.py [--tiny] [--epochs=3] [--links=1g,100m,10m] [--out=DIR]     # as root

The harness of `scaling.py`: two simulated hosts, a `tbf`-shaped veth link (1 Gbit/s,
100 Mbit/s, 10 Mbit/s), each worker pinned to a core of its own. For each model, link and
setting (`--sync=step`, `every:8`, `every:64`, `epoch`, the last three also with DiLoCo's
Nesterov outer step, and `step` with a bfloat16 all-reduce), one run of the main job on
the two workers (global batch 64, full epochs):

- seconds from start to the end of the first epoch whose test accuracy reaches the
  target (CNN on `shapes`: 0.98; transformer on `tokens`: 0.75), or none;
- the final test accuracy;
- bytes each host sent over the link during the run (the veth's own counters: every
  all-reduce, metric and control message included).

Writes `sync.json` and `sync.png`; the links of a run replace theirs in an existing
`sync.json` of the same epochs and keep the others, each with the date it was measured.
One run per cell: the spread of this machine's runs is in `scaling.json` and `results.json`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from run import environment  # noqa: E402
from scaling import HOSTS  # noqa: E402
from scaling import LINKS  # noqa: E402
from scaling import PY  # noqa: E402
from scaling import VETH  # noqa: E402
from scaling import _tf_config  # noqa: E402
from scaling import _wait  # noqa: E402
from scaling import on_host  # noqa: E402
from scaling import shape  # noqa: E402
from scaling import two_hosts  # noqa: E402

TARGETS = {"cnn": 0.98, "transformer": 0.75}
LINKS = {**LINKS, "10 Mbit/s": ("10mbit", "32kbit", 10e6)}
LINK_NAMES = {"1g": "1 Gbit/s", "100m": "100 Mbit/s", "10m": "10 Mbit/s"}
SETTINGS = {
    "step": [],
    "step, bfloat16 all-reduce": ["--allreduce_dtype=bfloat16"],
    "every:8": ["--sync=every:8"],
    "every:64": ["--sync=every:64"],
    "epoch": ["--sync=epoch"],
    "every:8, nesterov": ["--sync=every:8", "--outer_optimizer=nesterov"],
    "every:64, nesterov": ["--sync=every:64", "--outer_optimizer=nesterov"],
    "epoch, nesterov": ["--sync=epoch", "--outer_optimizer=nesterov"],
}


def sent_bytes() -> list[int]:
    """Bytes each host has sent over its end of the link so far."""
    counts = []
    for (name, _, _), end in zip(HOSTS, VETH):
        shown = subprocess.run(["ip", "-n", name, "-s", "-j", "link", "show", "dev", end],
                               check=True, capture_output=True, text=True).stdout
        counts.append(json.loads(shown)[0]["stats64"]["tx"]["bytes"])
    return counts


def run(scratch, model, flags, *, epochs, steps, tag) -> dict:
    model_dir = f"{scratch}/{tag}"
    command = [PY, "-m", "distrib_tf.train", f"--model={model}", f"--epochs={epochs}", "--global_batch_size=64",
               f"--model_dir={model_dir}", *flags, *([f"--steps_per_epoch={steps}"] if steps else [])]
    before, started = sent_bytes(), time.time()
    _wait([on_host(i, command, {"TF_CONFIG": _tf_config(i)}) for i in range(2)], timeout=1800)
    after = sent_bytes()
    with open(f"{model_dir}/summary.json") as f:
        summary = json.load(f)
    reached = next((end - started for epoch, end in zip(summary["epochs"], summary["epoch_end_unix_times"])
                    if epoch["val_accuracy"] >= TARGETS[model]), None)
    return {"seconds_to_target": reached, "final_accuracy": summary["final"]["accuracy"],
            "wall_seconds": summary["epoch_end_unix_times"][-1] - started,
            "bytes_sent_per_worker": max(b - a for a, b in zip(before, after)),
            "accuracy_by_epoch": [e["val_accuracy"] for e in summary["epochs"]]}


def plot(results, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    models = list(results["models"])
    columns = max(len(results["models"][model]) for model in models)
    fig, axes = plt.subplots(len(models), columns, figsize=(5.5 * columns, 3.8 * len(models)), squeeze=False)
    fig.suptitle("x: times sooner than step; final accuracy and its difference from step's. Blue: within 1 point "
                 "(counts for the goal); orange: more than 1 point below; gray: target not reached", fontsize=9)
    for ax in axes.flat:
        ax.set_visible(False)
    for row, model in enumerate(models):
        for ax, link in zip(axes[row], results["models"][model]):
            ax.set_visible(True)
            _bars(ax, model, link, results["models"][model][link])
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)


def judged(rows) -> dict:
    """Each setting against `step`: how many times sooner it reaches the target, its final
    accuracy's difference in points, and whether it counts for the goal (within 1 point)."""
    step = rows["step"]
    out = {}
    for name, row in rows.items():
        reached = row["seconds_to_target"]
        points = 100 * (row["final_accuracy"] - step["final_accuracy"])
        out[name] = {"speedup": step["seconds_to_target"] / reached if reached and step["seconds_to_target"] else None,
                     "points": points, "counts": bool(reached) and points >= -1.0}
    return out


def _bars(ax, model, link, rows):
    names = list(rows)
    verdicts = judged(rows)
    seconds = [rows[n]["seconds_to_target"] or 0 for n in names]
    colors = ["C0" if verdicts[n]["counts"] else "C1" if rows[n]["seconds_to_target"] else "lightgray" for n in names]
    bars = ax.barh(names, seconds, color=colors)
    for bar, name in zip(bars, names):
        verdict = verdicts[name]
        label = (f"x{verdict['speedup']:.2f}, " if verdict["speedup"] else "not reached, ") + (
            f"final {rows[name]['final_accuracy']:.4f} ({verdict['points']:+.1f} pt), "
            f"{rows[name]['bytes_sent_per_worker'] / 1e6:.0f} MB")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=6)
    best = max((v["speedup"] for v in verdicts.values() if v["counts"] and v["speedup"]), default=None)
    ax.set_title(f"{model}, {link}\nbest within 1 point: " + (f"x{best:.2f}" if best else "none"), fontsize=9)
    ax.set_xlabel(f"seconds to test accuracy {TARGETS[model]}", fontsize=8)
    ax.set_xlim(0, max(seconds) * 2.2 if any(seconds) else 1)
    ax.invert_yaxis()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--links", default="1g,100m,10m", help="shaped links, comma-separated: 1g, 100m, 10m")
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--replot", action="store_true", help="only draw sync.png again from sync.json")
    args = parser.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "sync.json")) as f:
            plot(json.load(f), os.path.join(args.out, "sync.png"))
        return
    if os.geteuid() != 0:
        sys.exit("benchmarks/sync.py: cannot run here: it needs root (network namespaces); see scaling.py")
    chosen = ["100m"] if args.tiny else args.links.split(",")
    if not chosen or not set(chosen) <= set(LINK_NAMES):
        sys.exit(f"benchmarks/sync.py: error: --links={args.links}: expected some of {','.join(LINK_NAMES)}")
    links = {LINK_NAMES[k]: LINKS[LINK_NAMES[k]] for k in chosen}
    settings = {k: SETTINGS[k] for k in (["step", "every:8"] if args.tiny else SETTINGS)}
    epochs, steps = (1, 10) if args.tiny else (args.epochs, None)
    out = os.path.join(args.out, "sync.json")
    results = {"epochs": epochs, "targets": TARGETS, "models": {}, "links": {}}
    if os.path.exists(out):
        with open(out) as f:
            earlier = json.load(f)
        if earlier.get("epochs") == epochs and "links" in earlier:  # Keep the links not rerun.
            results = earlier
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch, two_hosts():
        for link, (rate, burst, _) in links.items():
            shape(rate, burst)
            link_started = time.time()
            for model in ("cnn", "transformer"):
                rows = results["models"].setdefault(model, {})[link] = {}
                for name, flags in settings.items():
                    rows[name] = run(scratch, model, flags, epochs=epochs, steps=steps,
                                     tag=f"{model}_{rate}_{len(rows)}")
                    print(f"{model}, {link}, {name}: {rows[name]}", flush=True)
            results["links"][link] = {"environment": environment(), "seconds": time.time() - link_started}
    for model, rows in results["models"].items():  # Fastest link first.
        results["models"][model] = dict(sorted(rows.items(), key=lambda item: -LINKS[item[0]][2]))
    os.makedirs(args.out, exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "sync.png"))
    print(f"wrote {out} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
