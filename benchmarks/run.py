"""`make bench`: distrib_tf against baselines run side by side, interleaved, repeated.

    python benchmarks/run.py [--tiny] [--reps=5] [--parts=p1,p2,p3,p4] [--no_cpu_binding] [--out=DIR]

Each figure compares two sides measured in this run, alternately (A B, B A, A B, ...),
`--reps` times each; `results.json` holds every value with its min, median and max, and
the versions and machine (the previous `results.json` becomes `results.previous.json`, to
compare two runs). `--tiny` runs every part at a toy size, to check the scripts.

- P1: the main job on 2 workers through distrib_tf (whose launcher binds each worker to
  its share of the cores and sizes its thread pools; `--no_cpu_binding` turns that off,
  so that both sides run with TensorFlow's default threads) (`distrib-tf-launch --workers=2 --
  python -m distrib_tf.train`) / the same training written by hand (`baseline.py`: same
  data read the same way, same model, hand-set TF_CONFIG). Two ratios: training-step time
  (the same timer on both sides), and wall time per epoch after the first (validation,
  backups and checkpoints included on distrib_tf's side; the baseline has none).
- P2: step time on the real input pipeline / on one cached batch repeated, in the same
  run, on 2 workers (`pipeline.py`): each model on its offline dataset, and the CNN on
  `shapes` read from ArrayRecord shards. Goal <= 1.05.
- P3: all-reduce bus bandwidth of 2 workers (nccl-tests' definition: for 2 ranks, the
  bytes reduced / seconds) / the per-direction rate `iperf3 --bidir` measures between two
  processes over the same path (loopback), by size from 100 KB (the gradients of our
  models are 0.2-0.4 MB) to 256 MB.
- P4: seconds from start to the first training step, and to the end, of the same
  `distrib_tf.train` through the launcher / started by hand with TF_CONFIG. Goal <= 1.1.
"""

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from distrib_tf.cluster import ClusterSpec  # noqa: E402  (no TensorFlow here)

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
PY = sys.executable
TRAIN = [PY, "-m", "distrib_tf.train"]


def spread(values) -> dict:
    values = [float(v) for v in values]
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "values": values}


def environment() -> dict:
    versions = subprocess.run(
        [PY, "-c", "import tensorflow as tf, keras; print(tf.__version__, keras.__version__)"],
        env=ENV, capture_output=True, text=True, check=True).stdout.split()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo", encoding="utf-8")
                if line.startswith("model name")), platform.processor())
    return {"tensorflow": versions[0], "keras": versions[1], "python": platform.python_version(),
            "machine": f"{os.cpu_count()} CPU(s), {cpu}, {platform.system()} {platform.release()}",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _check(proc_or_result, output=""):
    if proc_or_result.returncode != 0:
        raise RuntimeError(f"{proc_or_result.args} failed:\n{output[-3000:]}")


LAUNCHER_FLAGS = []  # `--no_cpu_binding`: the launcher leaves CPUs and thread pools as the hand-started side has them.


def launched(command, timeout=900):
    """`command` on 2 local workers through distrib_tf's launcher; returns its start time."""
    started = time.time()
    result = subprocess.run([PY, "-m", "distrib_tf.launch", "--workers=2", *LAUNCHER_FLAGS, "--", *command],
                            env=ENV, capture_output=True, text=True, timeout=timeout)
    _check(result, result.stdout + result.stderr)
    return started


def by_hand(command, timeout=900):
    """`command` on 2 workers with a hand-set TF_CONFIG, as a user without distrib_tf would."""
    spec = ClusterSpec.local_workers(2).with_free_ports()
    started = time.time()
    procs = [subprocess.Popen(command, env={**ENV, "TF_CONFIG": spec.tf_config(task)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for task in spec.tasks]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        _check(proc, output)
    return started


def _steady(record) -> tuple[float, float]:
    """(median training-step seconds per epoch, wall seconds per epoch), first epoch left out."""
    ends = record["epoch_end_unix_times"]
    return statistics.median(record["epoch_step_seconds"][1:]), (ends[-1] - ends[0]) / (len(ends) - 1)


def _sides(rep: int, a: str, b: str) -> tuple[str, str]:
    return (a, b) if rep % 2 == 0 else (b, a)


def bench_p1(scratch, *, reps, epochs, steps, model="cnn") -> dict:
    step, wall = {"distrib_tf": [], "hand_written": []}, {"distrib_tf": [], "hand_written": []}
    for rep in range(reps):
        for side in _sides(rep, "distrib_tf", "hand_written"):
            out = f"{scratch}/p1_{side}_{rep}"
            if side == "distrib_tf":
                launched([*TRAIN, f"--model={model}", f"--epochs={epochs}", f"--steps_per_epoch={steps}",
                          f"--model_dir={out}"])
                record_file = f"{out}/summary.json"
            else:
                by_hand([PY, os.path.join(HERE, "baseline.py"), model, str(epochs), str(steps), "64",
                         f"{out}.json"])
                record_file = f"{out}.json"
            with open(record_file) as f:
                seconds, per_epoch = _steady(json.load(f))
            step[side].append(seconds / steps)
            wall[side].append(per_epoch)
    return {
        "p1_step_time_ratio": spread(a / b for a, b in zip(step["distrib_tf"], step["hand_written"])),
        "p1_wall_per_epoch_ratio": spread(a / b for a, b in zip(wall["distrib_tf"], wall["hand_written"])),
        "p1_step_seconds": {side: spread(v) for side, v in step.items()},
        "p1_wall_seconds_per_epoch": {side: spread(v) for side, v in wall.items()},
        "p1_setup": f"{model}, 2 workers, global batch 64, {epochs} epochs of {steps} steps, first epoch left out",
    }


def bench_p2(scratch, *, reps, steps) -> dict:
    """The two models on their offline datasets (in memory), and the CNN on `shapes` read from
    ArrayRecord shards (`cnn_streamed`)."""
    subprocess.run([PY, "-m", "distrib_tf.data", "prepare", "--dataset=shapes", f"--out={scratch}/shapes"],
                   env=ENV, check=True, capture_output=True)
    results = {}
    for name, model, dataset in (("cnn", "cnn", ""), ("transformer", "transformer", ""),
                                 ("cnn_streamed", "cnn", f"array_record:{scratch}/shapes")):
        out = f"{scratch}/p2_{name}.json"
        launched([PY, os.path.join(HERE, "pipeline.py"), model, "64", str(steps), str(reps), out, dataset])
        with open(out) as f:
            times = json.load(f)
        results[f"p2_pipeline_ratio_{name}"] = spread(r / c for r, c in zip(times["real"], times["cached"]))
        results[f"p2_step_seconds_{name}"] = {side: spread(v) for side, v in times.items()}
    return results


def iperf3_bidir(host="127.0.0.1", seconds=3, server_prefix=(), client_prefix=()) -> float:
    """Bytes per second each way while both directions run at once (`iperf3 --bidir`).

    The server listens on `host`; `*_prefix` run either side elsewhere (`ip netns exec NS`).
    """
    port = 5201
    if not server_prefix:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    server = subprocess.Popen([*server_prefix, "iperf3", "-s", "-B", host, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # Until the server listens and one test completes.
            client = subprocess.run([*client_prefix, "iperf3", "-c", host, "-p", str(port), "--bidir", "-t",
                                     str(seconds), "-J"], capture_output=True, text=True, timeout=seconds + 30)
            try:
                end = json.loads(client.stdout)["end"]
                rates = [end["sum_sent"]["bits_per_second"], end["sum_sent_bidir_reverse"]["bits_per_second"]]
                return min(rates) / 8
            except (ValueError, KeyError):
                time.sleep(0.2)
        raise RuntimeError(f"iperf3 gave no result: {client.stdout[-1000:]} {client.stderr[-1000:]}")
    finally:
        server.kill()
        server.wait()


def bench_p3(scratch, *, reps, sizes_mb) -> dict:
    ceilings, allreduce = [], {}
    for rep in range(reps):  # The ceiling and the all-reduce, alternately.
        ceilings.append(iperf3_bidir())
        if rep == 0:
            out = f"{scratch}/p3.json"
            by_hand([PY, os.path.join(HERE, "allreduce.py"), ",".join(map(str, sizes_mb)), str(reps), "1", "0", out])
            with open(out) as f:
                allreduce = json.load(f)
    ceiling = spread(ceilings)
    by_size = {}
    for size in sizes_mb:
        busbw = [size * 2**20 / s for s in allreduce[str(size)]]  # 2 ranks: bus = algorithm bandwidth.
        by_size[str(size)] = {"bus_bytes_per_second": spread(busbw),
                              "fraction_of_ceiling": spread(b / ceiling["median"] for b in busbw)}
    return {"p3_ceiling_bytes_per_second": ceiling, "p3_allreduce": by_size,
            "p3_setup": "2 workers, one float32 tensor, ring; ceiling: iperf3 --bidir over 127.0.0.1"}


def bench_p4(scratch, *, reps, epochs, steps) -> dict:
    first, total = {"launcher": [], "by_hand": []}, {"launcher": [], "by_hand": []}
    for rep in range(reps):
        for side in _sides(rep, "launcher", "by_hand"):
            model_dir = f"{scratch}/p4_{side}_{rep}"
            command = [*TRAIN, f"--epochs={epochs}", f"--steps_per_epoch={steps}", f"--model_dir={model_dir}"]
            started = (launched if side == "launcher" else by_hand)(command)
            ended = time.time()
            with open(f"{model_dir}/summary.json") as f:
                summary = json.load(f)
            first[side].append(summary["first_step_unix_time"] - started)
            total[side].append(ended - started)
    return {
        "p4_first_step_ratio": spread(a / b for a, b in zip(first["launcher"], first["by_hand"])),
        "p4_total_ratio": spread(a / b for a, b in zip(total["launcher"], total["by_hand"])),
        "p4_seconds_to_first_step": {side: spread(v) for side, v in first.items()},
        "p4_seconds_total": {side: spread(v) for side, v in total.items()},
    }


def plot_allreduce(results, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    sizes = [float(s) for s in results["p3_allreduce"]]
    rows = list(results["p3_allreduce"].values())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    median = [r["bus_bytes_per_second"]["median"] / 1e6 for r in rows]
    low = [m - r["bus_bytes_per_second"]["min"] / 1e6 for m, r in zip(median, rows)]
    high = [r["bus_bytes_per_second"]["max"] / 1e6 - m for m, r in zip(median, rows)]
    ax.errorbar(sizes, median, yerr=[low, high], marker="o", capsize=3, label="all-reduce bus bandwidth")
    ax.axhline(results["p3_ceiling_bytes_per_second"]["median"] / 1e6, color="gray", linestyle="--",
               label="iperf3 --bidir, each way")
    ax.set(xscale="log", yscale="log", xlabel="MB reduced", ylabel="MB/s", title="2 workers over loopback")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a toy size, to check that the scripts run")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per side (default 5)")
    parser.add_argument("--parts", default="p1,p2,p3,p4",
                        help="which figures (default all); a subset is written to results.PARTS.json")
    parser.add_argument("--out", default=HERE, help="where results.json and allreduce.png go")
    parser.add_argument("--no_cpu_binding", action="store_true",
                        help="the launcher does not bind its tasks to CPUs nor size their thread pools, "
                             "so both sides of P1 and P4 run with TensorFlow's default threads")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if "p3" in parts and shutil.which("iperf3") is None:
        sys.exit("benchmarks/run.py: error: P3 needs iperf3 (apt-get install iperf3)")
    reps = 1 if args.tiny else args.reps
    if args.no_cpu_binding:
        LAUNCHER_FLAGS.append("--no_cpu_binding")
    started = time.time()
    results = {"environment": environment(), "reps": reps}
    sizes = {  # part: (tiny, full) keyword arguments
        "p1": ({"epochs": 2, "steps": 3}, {"epochs": 3, "steps": 80}),
        "p2": ({"steps": 6}, {"steps": 40}),
        "p3": ({"sizes_mb": [0.1, 1]}, {"sizes_mb": [0.1, 0.25, 1, 4, 16, 64, 256]}),
        "p4": ({"epochs": 1, "steps": 2}, {"epochs": 1, "steps": 20}),
    }
    benches = {"p1": bench_p1, "p2": bench_p2, "p3": bench_p3, "p4": bench_p4}
    with tempfile.TemporaryDirectory() as scratch:
        for part in parts:
            part_reps = 2 if args.tiny and part == "p3" else reps
            results.update(benches[part](scratch, reps=part_reps, **sizes[part][0 if args.tiny else 1]))
    results["seconds"] = time.time() - started
    os.makedirs(args.out, exist_ok=True)
    name = "results.json" if sorted(parts) == sorted(benches) else f"results.{'-'.join(parts)}.json"
    if name == "results.json" and os.path.exists(os.path.join(args.out, name)):  # Kept, to compare two runs.
        os.replace(os.path.join(args.out, name), os.path.join(args.out, "results.previous.json"))
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(results, f, indent=1)
    if "p3" in parts:
        plot_allreduce(results, os.path.join(args.out, "allreduce.png"))
    for key, value in results.items():
        if key.endswith("ratio") or key.startswith("p2_pipeline_ratio"):
            print(f"{key}: {value['median']:.3f} (min {value['min']:.3f}, max {value['max']:.3f})")
    print(f"wrote {os.path.join(args.out, name)} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
