"""What a resize costs, from the restart to the first step: `make bench-resize`.

The main job (CNN, float64, a global batch of 48, 20 steps an epoch, 2 epochs, a backup
every 5 steps) on local workers through the launcher, SIGTERMed in its second epoch (every
worker backs up one step, exit 75), then started again. For each restart it records the
seconds from starting the launcher to the end of the first step (`summary.json`'s
`first_step_unix_time`): start-up, the resume agreement, reading the backup (or, on the
worker a grow adds, receiving the state over the collective), tracing. Like with like: a
resize onto N workers is compared with a restart of a job that ran on N workers (the same
processes on the same 2 cores; only what the resize does differs): 2 -> 1 against 1 -> 1,
2 -> 3 against 3 -> 3. The cases run interleaved, `--repeats` times each; it prints the
median and the range of each, the ratio of each resize's median to its restart's, and
writes `benchmarks/resize.json`.
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
sys.path.insert(0, str(HERE))

from run import environment  # noqa: E402

ENV_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(HERE.parent)}
FLAGS = ["--float64", "--global_batch_size=48", "--steps_per_epoch=20", "--epochs=2", "--backup_every_steps=5"]


def _command(workers: int, model_dir) -> list[str]:
    return [sys.executable, "-m", "distrib_tf.launch", f"--workers={workers}", "--grace_period=30", "--",
            sys.executable, "-m", "distrib_tf.train", *FLAGS, f"--model_dir={model_dir}"]


def _environment():
    return {**os.environ, **ENV_QUIET}


CASES = {  # name: (workers preempted, workers restarted, the restart it is compared with)
    "1 -> 1 (a restart)": (1, 1, None),
    "2 -> 1 (shrink)": (2, 1, "1 -> 1 (a restart)"),
    "3 -> 3 (a restart)": (3, 3, None),
    "2 -> 3 (grow, empty disk)": (2, 3, "3 -> 3 (a restart)"),
}


def preempt(model_dir, workers: int) -> None:
    """A run on `workers`, SIGTERMed once the chief has begun its second epoch."""
    log = pathlib.Path(f"{model_dir}.preempt.out")
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(workers, model_dir), env=_environment(), stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "Epoch 2/2" not in log.read_text() and time.monotonic() < deadline:
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
    seconds = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name, (before, after, _) in CASES.items():  # Interleaved: the machine's drift hits all alike.
                model_dir = pathlib.Path(scratch) / f"{before}-{after}-{repeat}"
                preempt(model_dir, before)
                seconds[name].append(restart(model_dir, after))
                print(f"repeat {repeat + 1}: {name}: {seconds[name][-1]:.2f} s to the first step", flush=True)
    rows = {}
    for name, (_, _, baseline) in CASES.items():
        values = seconds[name]
        rows[name] = {"seconds": values, "median": statistics.median(values), "min": min(values), "max": max(values),
                      "compared_with": baseline,
                      "ratio_to_restart": statistics.median(values) / statistics.median(seconds[baseline])
                      if baseline else 1.0}
        print(f"{name:28s} median {rows[name]['median']:.2f} s (range {rows[name]['min']:.2f}-{rows[name]['max']:.2f})"
              + (f", {rows[name]['ratio_to_restart']:.2f}x {baseline}" if baseline else ""))
    pathlib.Path(args.out).write_text(json.dumps({"command": "make bench-resize", "environment": environment(),
                                                  "flags": FLAGS, "repeats": args.repeats, "layouts": rows},
                                                 indent=2) + "\n")


if __name__ == "__main__":
    main()
