"""What a resize costs, from the restart to the first step: `make bench-resize`.

The main job (CNN, float64, a global batch of 48, 20 steps an epoch, 2 epochs, a backup
every 5 steps) on 2 local workers through the launcher, SIGTERMed in its second epoch
(every worker backs up one step, exit 75), then started again on 1, 2 or 3 workers. For
each restart it records the seconds from starting the launcher to the end of the first
step (`summary.json`'s `first_step_unix_time`): start-up, the resume agreement, reading the
backup (or, on the worker a grow adds, receiving the state over the collective), tracing.
The restart on 2 workers is the baseline: what any restart costs. The layouts run
interleaved, `--repeats` times each; it prints the median and the range of each, and the
ratio of each median to the baseline's, and writes `benchmarks/resize.json`.
"""

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ENV_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(HERE.parent)}
FLAGS = ["--float64", "--global_batch_size=48", "--steps_per_epoch=20", "--epochs=2", "--backup_every_steps=5"]


def _command(workers: int, model_dir) -> list[str]:
    return [sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}", "--grace_period=30", "--",
            sys.executable, "-m", "distrib_tf.train", *FLAGS, f"--model_dir={model_dir}"]


def _environment():
    return {**os.environ, **ENV_QUIET}


def preempt(model_dir) -> None:
    """A 2-worker run, SIGTERMed once worker:1 has finished its first epoch."""
    log = pathlib.Path(f"{model_dir}.preempt.out")
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(2, model_dir), env=_environment(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "worker:1 epoch 1/2" not in log.read_text() and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    if proc.wait(timeout=120) != 75:
        raise RuntimeError(f"expected exit 75:\n{log.read_text()[-3000:]}")


def restart(model_dir, workers: int) -> float:
    """Seconds from starting the launcher on `workers` to the end of the first step."""
    started = time.time()
    done = subprocess.run(_command(workers, model_dir), env=_environment(), capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 or "resumes at step" not in done.stdout:
        raise RuntimeError(done.stdout[-3000:])
    summary = json.loads((pathlib.Path(model_dir) / "summary.json").read_text())
    return summary["first_step_unix_time"] - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "resize.json"))
    args = parser.parse_args()
    layouts = {"2 -> 2 (a restart)": 2, "2 -> 1 (shrink)": 1, "2 -> 3 (grow, empty disk)": 3}
    seconds = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name, workers in layouts.items():  # Interleaved: the machine's drift hits all alike.
                model_dir = pathlib.Path(scratch) / f"{workers}-{repeat}"
                preempt(model_dir)
                seconds[name].append(restart(model_dir, workers))
                print(f"repeat {repeat + 1}: {name}: {seconds[name][-1]:.2f} s to the first step", flush=True)
    base = statistics.median(seconds["2 -> 2 (a restart)"])
    rows = {name: {"seconds": values, "median": statistics.median(values), "min": min(values), "max": max(values),
                   "ratio_to_restart": statistics.median(values) / base} for name, values in seconds.items()}
    for name, row in rows.items():
        print(f"{name:28s} median {row['median']:.2f} s (range {row['min']:.2f}-{row['max']:.2f}), "
              f"{row['ratio_to_restart']:.2f}x a restart on the same layout")
    pathlib.Path(args.out).write_text(json.dumps({"command": "make bench-resize", "flags": FLAGS,
                                                  "repeats": args.repeats, "layouts": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
