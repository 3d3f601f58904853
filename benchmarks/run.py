"""`make bench`: measure distrib_tf against baselines run side by side, write the results.

Every ratio compares two things measured in this same run, interleaved (A, B, A, B, ...),
medians reported. Writes `results.json`, `results.md` (the table) and PNG plots into
`--out` (default: this folder).

    python benchmarks/run.py [--tiny] [--rounds=3] [--out=DIR]

`--tiny` runs every benchmark at a toy size, to check that the scripts work.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from distrib_tf.cluster import ClusterSpec  # noqa: E402  (no TensorFlow here)

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
SPEC_2 = os.path.join(ROOT, "cluster_specs", "local_2workers.json")
PY = sys.executable


def _run(cmd, env=None, timeout=900):
    result = subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result.stdout


def _hand_cluster(cmd, workers=2, timeout=900):
    """Runs `cmd` once per worker with a hand-set TF_CONFIG, as a user without distrib_tf would."""
    spec = ClusterSpec.from_dict({"cluster": {"worker": ["127.0.0.1:0"] * workers}}).with_free_ports()
    procs = [subprocess.Popen(cmd, env={**ENV, "TF_CONFIG": spec.tf_config(task)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for task in spec.tasks]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(o[-2000:] for o in outputs))


def _train(model_dir, *flags, workers=1):
    cmd = [PY, "-m", "distrib_tf.train", f"--model_dir={model_dir}", *flags]
    if workers > 1:
        cmd = [PY, "-m", "distrib_tf.launch", f"--cluster_spec={SPEC_2}", "--", *cmd]
    launched = time.time()
    _run(cmd)
    with open(os.path.join(model_dir, "summary.json")) as f:
        summary = json.load(f)
    summary["startup_seconds"] = summary["first_step_unix_time"] - launched
    return summary


def bench_overhead_and_startup(scratch, *, rounds, epochs, steps):
    """p1 and p4: the distrib_tf job against a hand-written MWMS script, 2 workers each."""
    ours, baseline = [], []
    for r in range(rounds):
        ours.append(_train(f"{scratch}/p1_ours_{r}", "--model=cnn", f"--epochs={epochs}",
                           f"--steps_per_epoch={steps}", workers=2))
        out = f"{scratch}/p1_base_{r}.json"
        launched = time.time()
        _hand_cluster([PY, os.path.join(HERE, "baseline_mwms.py"), str(epochs), str(steps), "64", out])
        with open(out) as f:
            base = json.load(f)
        base["startup_seconds"] = base["first_step_unix_time"] - launched
        baseline.append(base)
    ours_rate = statistics.median(s["examples_per_second"] for s in ours)
    base_rate = statistics.median(b["examples_per_second"] for b in baseline)
    ours_start = statistics.median(s["startup_seconds"] for s in ours)
    base_start = statistics.median(b["startup_seconds"] for b in baseline)
    return {
        "p1_overhead_ratio": base_rate / ours_rate,
        "p1_examples_per_second": {"distrib_tf": ours_rate, "hand_written": base_rate},
        "p4_startup_ratio": ours_start / base_start,
        "p4_seconds_to_first_step": {"distrib_tf": ours_start, "hand_written": base_start},
    }


def bench_pipeline_and_throughput(scratch, *, steps, epochs, full):
    """p2 and the throughput table: each configuration of the main job, and its pipeline alone."""
    throughput, results = [], {}
    precisions = ["off", "bfloat16"] if full else ["off"]
    layouts = [("1 replica", ["--strategy=one_device"], 1)]
    if full:
        layouts += [("2 replicas", ["--cpu_replicas=2"], 1), ("2 workers", [], 2)]
    for model, dataset in (("cnn", "shapes"), ("transformer", "tokens")):
        pipeline = json.loads(_run([PY, os.path.join(HERE, "pipeline.py"), dataset, "64", str(steps)]))
        for layout, flags, workers in layouts:
            for precision in precisions:
                summary = _train(f"{scratch}/tp_{model}_{workers}_{len(flags)}_{precision}", f"--model={model}",
                                 f"--epochs={epochs}", f"--steps_per_epoch={steps}",
                                 f"--mixed_precision={precision}", *flags, workers=workers)
                throughput.append({"model": model, "layout": layout, "mixed_precision": precision,
                                   "examples_per_second": summary["examples_per_second"]})
        training = next(t["examples_per_second"] for t in throughput
                        if t["model"] == model and t["layout"] == "1 replica" and t["mixed_precision"] == "off")
        results[f"p2_pipeline_headroom_{model}"] = pipeline["examples_per_second"] / training
        results[f"p2_pipeline_examples_per_second_{model}"] = pipeline["examples_per_second"]
    results["throughput"] = throughput
    return results


def _exchange_seconds(size: int) -> float:
    """Two processes send each other `size` bytes at once over loopback TCP; seconds."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    peer = subprocess.Popen([PY, "-c", _PEER, str(port), str(size)])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.recv(1)  # The peer is ready.
    payload = bytearray(size)
    start = time.perf_counter()
    sender = threading.Thread(target=conn.sendall, args=(b"g" + payload,))
    sender.start()
    _recv_exactly(conn, size)
    sender.join()
    seconds = time.perf_counter() - start
    conn.close()
    server.close()
    peer.wait()
    return seconds


def _recv_exactly(conn, size):
    view, got = memoryview(bytearray(size)), 0
    while got < size:
        got += conn.recv_into(view[got:], min(size - got, 1 << 22))


_PEER = """
import socket, sys, threading
port, size = int(sys.argv[1]), int(sys.argv[2])
conn = socket.create_connection(("127.0.0.1", port))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn.sendall(b"r")
assert conn.recv(1) == b"g"
sender = threading.Thread(target=conn.sendall, args=(bytearray(size),))
sender.start()
view, got = memoryview(bytearray(size)), 0
while got < size:
    got += conn.recv_into(view[got:], min(size - got, 1 << 22))
sender.join()
"""


def bench_allreduce(scratch, *, sizes_mb, repeats):
    """p3: 2-worker ring all-reduce bandwidth / loopback TCP exchange bandwidth, same sizes."""
    variants = {"1 tensor": (1, 0), "64 tensors": (64, 0), "64 tensors, packed 32 MB": (64, 32 << 20)}
    seconds = {}
    for name, (pieces, pack) in variants.items():
        out = f"{scratch}/allreduce_{pieces}_{pack}.json"
        _hand_cluster([PY, os.path.join(HERE, "allreduce.py"), ",".join(map(str, sizes_mb)),
                       str(repeats), str(pieces), str(pack), out])
        with open(out) as f:
            seconds[name] = json.load(f)
    loopback = {str(s): statistics.median(_exchange_seconds(int(s * 2**20)) for _ in range(repeats))
                for s in sizes_mb}
    sweep = []
    for size in sizes_mb:
        row = {"megabytes": size, "loopback_bytes_per_second": size * 2**20 / loopback[str(size)]}
        for name in variants:
            row[f"allreduce_bytes_per_second ({name})"] = size * 2**20 / seconds[name][str(size)]
        sweep.append(row)
    fractions = {str(r["megabytes"]): r["allreduce_bytes_per_second (1 tensor)"] / r["loopback_bytes_per_second"]
                 for r in sweep}
    return {"p3_allreduce_fraction_of_loopback": statistics.median(fractions.values()),
            "p3_fraction_by_megabytes": fractions, "p3_sweep": sweep}


def write_plots(results, out):
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib is missing: pip install -e '.[bench]' for the plots", file=sys.stderr)
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = results["throughput"]
    labels = [f"{r['model']}\n{r['layout']}\n{r['mixed_precision']}" for r in rows]
    ax.bar(range(len(rows)), [r["examples_per_second"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("examples / second")
    ax.set_title("Main-job throughput (2 shared CPU cores)")
    fig.tight_layout()
    paths.append(os.path.join(out, "throughput.png"))
    fig.savefig(paths[-1], dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    sweep = results["p3_sweep"]
    sizes = [r["megabytes"] for r in sweep]
    for key in sweep[0]:
        if key != "megabytes":
            ax.plot(sizes, [r[key] / 2**20 for r in sweep], marker="o", label=key.replace("_bytes_per_second", ""))
    ax.set_xscale("log")
    ax.set_xlabel("MB per all-reduce")
    ax.set_ylabel("MB / second")
    ax.set_title("2-worker all-reduce against loopback TCP")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out, "allreduce.png"))
    fig.savefig(paths[-1], dpi=120)
    return paths


def table(results) -> str:
    goals = {"p1_overhead_ratio": "<= 1.02", "p2_pipeline_headroom_cnn": ">= 3",
             "p2_pipeline_headroom_transformer": ">= 3", "p3_allreduce_fraction_of_loopback": ">= 0.5",
             "p4_startup_ratio": "<= 1.2"}
    lines = ["| figure | measured | goal |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {results[k]:.3f} | {g} |" for k, g in goals.items()]
    lines += ["", "| model | layout | mixed precision | examples/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['layout']} | {r['mixed_precision']} | {r['examples_per_second']:.0f} |"
              for r in results["throughput"]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="benchmarks/run.py")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: check the scripts run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args(argv)
    full = not args.tiny
    started = time.time()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "python": platform.python_version()},
                   "command": "make bench" if full else "python benchmarks/run.py --tiny"}
        results.update(bench_overhead_and_startup(scratch, rounds=args.rounds if full else 1,
                                                  epochs=3 if full else 2, steps=60 if full else 3))
        results.update(bench_pipeline_and_throughput(scratch, steps=60 if full else 3,
                                                     epochs=3 if full else 2, full=full))
        results.update(bench_allreduce(scratch, sizes_mb=[1, 4, 16, 64, 256] if full else [1],
                                       repeats=5 if full else 2))
    results["seconds"] = time.time() - started
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table(results) + "\n")
    results["plots"] = write_plots(results, args.out)
    print(table(results))
    print(f"\n{results['seconds']:.0f} s; wrote {args.out}/results.json, results.md", *results["plots"])


if __name__ == "__main__":
    main()
