"""What backups cost a model of real size: `make bench-backup`.

A user's script on `distrib_tf.Run` (`--worker`): a 4-layer Dense model of 33.6 M
parameters under Adam (403 MB of weights and slots), 80 steps of a global batch of 64, one
epoch. Cases, each on one process and on 2 workers through the launcher:

- `epoch ends`: backups at the epoch's end only (the baseline);
- `every 5, background`: a backup every 5 steps, written in the background (the default);
- `every 5, synchronous`: the same with `backup_in_background=False` (each backup waits
  for its files: what every backup cost before).

Like with like: the same script, data and steps; only the backup arguments differ. The
cases run interleaved, `--repeats` times each. Printed: the median and range of `fit`'s
seconds, the ratio of each case to `epoch ends` (per layout), the seconds a step waited per
backup (median, range; `summary.json`'s `backups`), and the seconds the writer spent in the
background. Written to `benchmarks/backups.json`.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import environment  # noqa: E402

ENV_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(HERE.parent)}
CASES = {"epoch ends": [], "every 5, background": ["--every=5"],
         "every 5, synchronous": ["--every=5", "--synchronous"]}
WIDTH, STEPS, BATCH = 4096, 80, 64


def worker(args) -> None:
    """One run of the script (every worker of it); the chief prints one JSON line."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    import distrib_tf  # pylint: disable=import-outside-toplevel

    run = distrib_tf.Run(args.model_dir, backup_every_steps=args.every, backup_in_background=not args.synchronous)
    rng, width, steps = np.random.default_rng(0), args.width, args.steps
    x = rng.normal(size=(steps * BATCH, width // 2)).astype("float32")
    y = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    model = keras.Sequential([keras.Input((width // 2,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width // 2),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    started = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    seconds = time.perf_counter() - started
    if run.is_chief:
        print("RESULT " + json.dumps({"fit_seconds": seconds, "parameters": model.count_params(),
                                      "backups": run.summary["backups"]}), flush=True)
    run.end()


def one(case: str, workers: int, folder: str, size: list) -> dict:
    model_dir = tempfile.mkdtemp(dir=folder)
    script = [sys.executable, os.path.abspath(__file__), "--worker", f"--model_dir={model_dir}", *size, *CASES[case]]
    command = script if workers == 1 else [sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}",
                                           "--", *script]
    done = subprocess.run(command, env={**os.environ, **ENV_QUIET}, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode != 0 or not lines:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    parser.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--synchronous", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case (default 2)")
    parser.add_argument("--layouts", default="1,2", help="numbers of workers, comma-separated (default 1,2)")
    parser.add_argument("--out", default=str(HERE / "backups.json"))
    parser.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a toy size, to check that it runs (make soak)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    layouts = [int(n) for n in args.layouts.split(",")]
    size = ["--width=64", "--steps=10"] if args.tiny else [f"--width={args.width}", f"--steps={args.steps}"]
    runs = {(case, n): [] for n in layouts for case in CASES}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for n in layouts:
                for case in CASES:  # Interleaved: every case once per repeat.
                    runs[(case, n)].append(one(case, n, folder, size))
                    last = runs[(case, n)][-1]
                    print(f"[{repeat + 1}/{args.repeats}] {n} worker(s), {case}: fit {last['fit_seconds']:.1f} s, "
                          f"{last['backups']['count']} backups", flush=True)
    results = {"environment": environment(),
               "parameters": runs[(next(iter(CASES)), layouts[0])][0]["parameters"], "steps": int(size[1][8:]),
               "global_batch": BATCH, "repeats": args.repeats, "cases": []}
    for n in layouts:
        base = statistics.median(r["fit_seconds"] for r in runs[("epoch ends", n)])
        for case in CASES:
            each = runs[(case, n)]
            fit = [r["fit_seconds"] for r in each]
            blocked = [r["backups"]["blocked_seconds"] / max(r["backups"]["count"], 1) for r in each]
            results["cases"].append({
                "workers": n, "case": case, "fit_seconds": _spread(fit),
                "ratio_to_epoch_ends": statistics.median(fit) / base,
                "ratios": [f / base for f in fit],
                "backups": each[0]["backups"]["count"], "blocked_seconds_per_backup": _spread(blocked),
                "write_seconds": _spread([r["backups"]["write_seconds"] for r in each])})
    print(f"\n{results['parameters'] / 1e6:.1f} M parameters, {results['steps']} steps of {BATCH}, "
          f"{args.repeats} runs of each case, interleaved")
    print(f"{'workers':>7}  {'case':<22} {'fit s (median, range)':<24} {'ratio':>6}  "
          f"{'backups':>7}  {'blocked s/backup (median, range)':<34} {'written in background s'}")
    for row in results["cases"]:
        fit, blocked, write = row["fit_seconds"], row["blocked_seconds_per_backup"], row["write_seconds"]
        print(f"{row['workers']:>7}  {row['case']:<22} {fit['median']:6.1f} ({fit['min']:.1f}-{fit['max']:.1f}){'':<8}"
              f" {row['ratio_to_epoch_ends']:6.2f}  {row['backups']:>7}  "
              f"{blocked['median']:.3f} ({blocked['min']:.3f}-{blocked['max']:.3f}){'':<14} {write['median']:.1f}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
