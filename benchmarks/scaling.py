"""`make bench-scaling`: weak scaling of MultiWorkerMirroredStrategy over a shaped link.

    python benchmarks/scaling.py [--tiny] [--reps=3] [--out=DIR]     # as root

Two simulated hosts: network namespaces joined by a veth pair whose both ends are shaped
with `tc ... tbf` to 10 Gbit/s, 1 Gbit/s and 100 Mbit/s in turn. Each worker is pinned to
a core of its own (`taskset`, one intra-op and one inter-op thread), so that compute does
not compete. Per model and link, alternately, `--reps` times:

- one pinned worker alone (`--strategy=one_device`, batch 32);
- two such single workers side by side, one per host, at once and apart (no communication):
  what one worker's step costs while the other core computes too;
- two pinned workers, one per host, by TF_CONFIG (global batch 64: 32 each).

Weak-scaling efficiency = examples/s of the two / (2 x examples/s of the one), the
training steps' rate from each run's summary (first epoch left out).

The bound, in the same repetition: the step's collectives alone between the same two pinned
processes (`step_collectives.py`: the model's gradients through the optimizer's all-reduce,
the logged values in their pack as `distrib_tf.keras.step_logs` sends them, no compute), `c`
seconds a step. With `t` the one worker's
step, the efficiency these collectives allow is t / (t + c) (TensorFlow's collectives on this
link and core), and ours is reported as a fraction of it. Beside it, the link's own bound:
t / (t + gradient bytes / shaped rate) (a 2-rank ring sends each byte once each way), what a
collective with no latency and no CPU cost would allow. And this machine's bound:
t / (s + c), with `s` the step of a worker side by side with another (what a core computes
while the other computes too), the efficiency two workers could reach if their only cost
beyond that were the collectives alone; and its synchronous form t / (s + p + c), with `p`
what waiting for the slower of the two side-by-side workers would add to a step
(`straggler`): no synchronous step ends before the later of two computes. And the same with
the collectives paced (`paced_bound`): t / (s + p + c'), with c' the step's collectives alone
as above, but each after a computation as long as the one worker's step, as a step's
all-reduce comes after its compute (TensorFlow's collective is slower so than back to back).
Every training run is the same program, `step_times.py`, writing every step's wall time and
its wait on the all-reduce; for the two workers this splits their step into their own compute
and the wait, and the wait into the collective (what the worker that came last waits) and the
time a worker waits for the other. Then the all-reduce bus bandwidth between the two hosts
(`allreduce.py`) as a fraction of the shaped rate, beside the rate `iperf3 --bidir` measures
each way over the same link. Writes `scaling.json` and `scaling.png`.
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run import environment  # noqa: E402
from run import iperf3_bidir  # noqa: E402
from run import spread  # noqa: E402

PY = sys.executable
HOSTS = [("dtfbench_a", "10.82.0.1", "0"), ("dtfbench_b", "10.82.0.2", "1")]  # namespace, address, core
VETH = ["vdtfbench_a", "vdtfbench_b"]
# tbf: the burst must hold at least rate / HZ of bytes, or the link cannot reach its rate.
LINKS = {"10 Gbit/s": ("10gbit", "4mbit", 10e9), "1 Gbit/s": ("1gbit", "512kbit", 1e9),
         "100 Mbit/s": ("100mbit", "64kbit", 100e6)}
PINNED = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
          "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts():
    try:
        for name, _, _ in HOSTS:
            _ip("netns", "add", name)
        _ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for (name, address, _), end in zip(HOSTS, VETH):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", end)
            _ip("-n", name, "link", "set", end, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield
    finally:
        for name, _, _ in HOSTS:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def shape(rate: str, burst: str):
    for (name, _, _), end in zip(HOSTS, VETH):
        subprocess.run(["tc", "-n", name, "qdisc", "replace", "dev", end, "root", "tbf", "rate", rate,
                        "burst", burst, "latency", "50ms"], check=True, capture_output=True, text=True)


def on_host(index: int, command, env=None) -> subprocess.Popen:
    name, _, core = HOSTS[index]
    return subprocess.Popen(["ip", "netns", "exec", name, "taskset", "-c", core, *command],
                            env={**os.environ, **PINNED, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=900):
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"{proc.args} failed:\n{output[-3000:]}")


def _tf_config(index: int, port: int = 2222) -> str:
    cluster = {"worker": [f"{address}:{port}" for _, address, _ in HOSTS]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def train_rate(scratch, model, workers, *, epochs, steps, tag, logs_apart=False) -> tuple[float, int, dict | None]:
    """The training steps' examples/s (of each worker for "side"), how many values a step logs,
    and what the steps' times say: for two workers where their step goes (`split_step`), for
    two side by side what the slower of them would add to a synchronous step (`straggler`).
    `workers`: 1, 2, or "side" (two single workers at once, one per host, no communication).
    `logs_apart`: the step as it was before `distrib_tf.keras.step_logs`, its logs in a
    collective of their own. Every case runs the same program, `step_times.py`."""
    model_dir = f"{scratch}/{tag}"
    flags = [f"--model={model}", f"--epochs={epochs}", f"--steps_per_epoch={steps}"]
    command = [PY, os.path.join(HERE, "step_times.py"), *(["--off=logs_in_gradients"] if logs_apart else []), *flags]
    alone = [*command, "--strategy=one_device", "--global_batch_size=32"]
    if workers == 1:
        _wait([on_host(0, [*alone, f"--model_dir={model_dir}"], {"STEP_TIMES_OUT": f"{model_dir}_steps_0.json"})])
    elif workers == "side":
        _wait([on_host(i, [*alone, f"--model_dir={model_dir}_{i}"], {"STEP_TIMES_OUT": f"{model_dir}_steps_{i}.json"})
               for i in range(2)])
        rates = [_summary(f"{model_dir}_{i}")["examples_per_second"] for i in range(2)]
        return statistics.mean(rates), 0, {"straggler": straggler(model_dir)}
    else:
        _wait([on_host(i, [*command, f"--model_dir={model_dir}", "--global_batch_size=64"],
                       {"TF_CONFIG": _tf_config(i), "STEP_TIMES_OUT": f"{model_dir}_steps_{i}.json"})
               for i in range(2)])
    summary = _summary(model_dir)
    epoch_keys = {"epoch", "epoch_seconds", "examples_per_second"}  # Written once an epoch, not by the step.
    logged = [k for k in summary["epochs"][0] if k not in epoch_keys and not k.startswith(("val_", "step_seconds_"))]
    return summary["examples_per_second"], len(logged), split_step(model_dir) if workers == 2 else None


def _steps(model_dir) -> list[list[tuple[float, float]]]:
    """Each of the two workers' (wall, waited) seconds a step, after the first epoch (`step_times.py`)."""
    rows = []
    for i in range(2):
        with open(f"{model_dir}_steps_{i}.json") as f:
            rows.append([(wall, waited) for epoch, wall, waited in json.load(f) if epoch >= 1])
    return rows


def split_step(model_dir) -> dict:
    """Medians over the steps after the first epoch, in seconds, of the two workers' rows
    (`step_times.py`): `wall`, a worker's step (mean of the two); `own`, its step without its
    wait on the all-reduce; `wait`, that wait; `collective`, the wait of the worker that came
    last to the all-reduce, which waits for nothing but the collective; `peer`, what a worker
    waits beyond that for the other (mean of the two: half the gap between their arrivals)."""
    steps = list(zip(*_steps(model_dir)))
    return {"wall": statistics.median(statistics.mean(w for w, _ in step) for step in steps),
            "own": statistics.median(statistics.mean(w - x for w, x in step) for step in steps),
            "wait": statistics.median(statistics.mean(x for _, x in step) for step in steps),
            "collective": statistics.median(min(x for _, x in step) for step in steps),
            "peer": statistics.median(statistics.mean(x for _, x in step) - min(x for _, x in step)
                                      for step in steps)}


def straggler(model_dir) -> float:
    """What waiting for the slower of two workers adds to a synchronous step, in seconds, from
    two single workers side by side: a step ends when the later of the two computes has, on
    average (a + b) / 2 + |a - b| / 2; this is the mean of |a - b| / 2 over every pair of
    their steps (a step of one against any step of the other: their steps are not in lockstep)."""
    a, b = ([wall for wall, _ in rows] for rows in _steps(model_dir))
    return statistics.mean(abs(x - y) for x in a for y in b) / 2


def _summary(model_dir) -> dict:
    with open(f"{model_dir}/summary.json") as f:
        return json.load(f)


def collectives_seconds(scratch, model, logged, steps, tag, pause=0.0) -> tuple[float, int]:
    """The median seconds of a step's collectives alone, and the gradient bytes (step_collectives.py);
    with `pause`, each after that many seconds of computation, as in a step."""
    out = f"{scratch}/{tag}.json"
    command = [PY, os.path.join(HERE, "step_collectives.py"), model, str(logged), str(steps), out,
               *([str(pause)] if pause else [])]
    _wait([on_host(i, command, {"TF_CONFIG": _tf_config(i, 2400)}) for i in range(2)])
    with open(out) as f:
        measured = json.load(f)
    return statistics.median(measured["step_seconds"]), measured["gradient_bytes"]


def allreduce(scratch, sizes_mb, repeats, tag) -> dict:
    out = f"{scratch}/{tag}.json"
    command = [PY, os.path.join(HERE, "allreduce.py"), ",".join(map(str, sizes_mb)), str(repeats), "1", "0", out]
    _wait([on_host(i, command, {"TF_CONFIG": _tf_config(i, 2300)}) for i in range(2)])
    with open(out) as f:
        return json.load(f)


def plot(results, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    links = list(results["links"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for offset, model in enumerate(("cnn", "transformer")):
        medians = [results["links"][link][model]["efficiency"]["median"] for link in links]
        low = [m - results["links"][link][model]["efficiency"]["min"] for m, link in zip(medians, links)]
        high = [results["links"][link][model]["efficiency"]["max"] - m for m, link in zip(medians, links)]
        left.bar([i + 0.4 * offset for i in range(len(links))], medians, width=0.4, yerr=[low, high],
                 capsize=3, label=model)
    left.axhline(0.9, color="gray", linestyle="--", label="goal 0.9 (CNN, 1 Gbit/s)")
    left.set(xticks=[i + 0.2 for i in range(len(links))], xticklabels=links, ylabel="weak-scaling efficiency",
             title="2 pinned workers / 2 x 1")
    left.legend(fontsize=8)
    for link in links:
        rows = results["links"][link]["allreduce"]
        right.plot([float(s) for s in rows], [r["fraction_of_link"]["median"] for r in rows.values()],
                   marker="o", label=link)
    right.axhline(0.9, color="gray", linestyle="--", label="goal 0.9")
    right.set(xscale="log", xlabel="MB reduced", ylabel="bus bandwidth / shaped rate", title="all-reduce")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--logs_apart", action="store_true",
                        help="also two workers with the logs in a collective of their own (the step before this "
                             "round), interleaved")
    parser.add_argument("--links", default=",".join(LINKS),
                        help=f"comma-separated, of {', '.join(LINKS)}; links not run keep their rows in scaling.json")
    args = parser.parse_args(argv)
    chosen = [link.strip() for link in args.links.split(",")]
    if any(link not in LINKS for link in chosen):
        sys.exit(f"benchmarks/scaling.py: --links={args.links!r}: expected some of {', '.join(LINKS)}")
    missing = [tool for tool in ("ip", "tc", "taskset", "iperf3") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing or (os.cpu_count() or 1) < 2:
        sys.exit("benchmarks/scaling.py: cannot run here: it needs root (network namespaces), "
                 f"2 cores or more, and ip, tc, taskset, iperf3 (missing: {', '.join(missing) or 'none'})")
    reps = 1 if args.tiny else args.reps
    epochs, steps = (2, 4) if args.tiny else (3, 30)
    sizes = [0.25, 1] if args.tiny else [0.25, 1, 4, 16]
    links = dict(list(LINKS.items())[1:2]) if args.tiny else {link: LINKS[link] for link in chosen}
    started = time.time()
    results = {"environment": environment(), "reps": reps, "links": {}}
    with tempfile.TemporaryDirectory() as scratch, two_hosts():
        for link, (rate, burst, bits) in links.items():
            shape(rate, burst)
            row = {"iperf3_bidir_bytes_per_second": spread(
                iperf3_bidir(HOSTS[0][1], server_prefix=["ip", "netns", "exec", HOSTS[0][0]],
                             client_prefix=["ip", "netns", "exec", HOSTS[1][0]]) for _ in range(reps)),
                "shaped_bytes_per_second": bits / 8}
            for model in ("cnn", "transformer"):
                one, side, two, splits, stragglers, apart, collectives, paced = [], [], [], [], [], [], [], []
                logged, gradient_bytes = 0, 0
                cases = (1, "side", 2, "c", "paced", *(["apart"] if args.logs_apart else []))
                for rep in range(reps):
                    for workers in (cases if rep % 2 == 0 else cases[::-1]):
                        tag = f"{rate}_{model}_{workers}_{rep}"
                        if workers == "c":  # The bound: the step's collectives alone.
                            seconds, gradient_bytes = collectives_seconds(scratch, model, logged or 3,
                                                                          40 if args.tiny else 300, tag)
                            collectives.append(seconds)
                            continue
                        if workers == "paced":  # The same, each after a computation as long as a step.
                            seconds, _ = collectives_seconds(scratch, model, logged or 3, 40 if args.tiny else 300,
                                                             tag, pause=32 / one[-1])
                            paced.append(seconds)
                            continue
                        rate_, logged_, times = train_rate(scratch, model, 2 if workers == "apart" else workers,
                                                          epochs=epochs, steps=steps, tag=tag,
                                                          logs_apart=workers == "apart")
                        logged = logged_ or logged
                        {1: one, "side": side, 2: two, "apart": apart}[workers].append(rate_)
                        if workers == 2:
                            splits.append(times)
                        elif workers == "side":
                            stragglers.append(times["straggler"])
                efficiency = [b / (2 * a) for a, b in zip(one, two)]
                step = [32 / a for a in one]  # The one worker's step: its batch is 32.
                side_step = [32 / a for a in side]  # The same, while the other core runs another.
                bound = [t / (t + c) for t, c in zip(step, collectives)]
                machine_bound = [t / (s + c) for t, s, c in zip(step, side_step, collectives)]
                synchronous_bound = [t / (s + p + c) for t, s, p, c in zip(step, side_step, stragglers, collectives)]
                paced_bound = [t / (s + p + c) for t, s, p, c in zip(step, side_step, stragglers, paced)]
                row[model] = {"one_worker_examples_per_second": spread(one),
                              "side_by_side_examples_per_second": spread(side),
                              "two_workers_examples_per_second": spread(two),
                              **{f"two_workers_{part}_seconds": spread(s[part] for s in splits)
                                 for part in ("wall", "own", "wait", "collective", "peer")},
                              "efficiency": spread(efficiency),
                              "collectives_step_seconds": spread(collectives), "gradient_bytes": gradient_bytes,
                              "logged_values": logged,
                              "bound": spread(bound),
                              "fraction_of_bound": spread(e / b for e, b in zip(efficiency, bound)),
                              "machine_bound": spread(machine_bound),
                              "fraction_of_machine_bound": spread(e / b for e, b in zip(efficiency, machine_bound)),
                              "side_by_side_straggler_seconds": spread(stragglers),
                              "synchronous_bound": spread(synchronous_bound),
                              "fraction_of_synchronous_bound": spread(e / b for e, b in zip(efficiency,
                                                                                            synchronous_bound)),
                              "paced_collectives_step_seconds": spread(paced),
                              "paced_bound": spread(paced_bound),
                              "fraction_of_paced_bound": spread(e / b for e, b in zip(efficiency, paced_bound)),
                              "link_bound": spread(t / (t + gradient_bytes / (bits / 8)) for t in step)}
                if apart:
                    row[model]["two_workers_logs_apart_examples_per_second"] = spread(apart)
                    row[model]["efficiency_logs_apart"] = spread(b / (2 * a) for a, b in zip(one, apart))
            times = allreduce(scratch, sizes, max(reps, 3), f"allreduce_{rate}")
            row["allreduce"] = {str(size): {
                "bus_bytes_per_second": spread(size * 2**20 / s for s in times[str(size)]),
                "fraction_of_link": spread(size * 2**20 / s / (bits / 8) for s in times[str(size)])}
                for size in sizes}
            results["links"][link] = row
            print(f"{link}: " + ", ".join(
                f"{m} efficiency {row[m]['efficiency']['median']:.2f}, bound {row[m]['bound']['median']:.2f}, "
                f"fraction of it {row[m]['fraction_of_bound']['median']:.2f}, of the synchronous bound "
                f"{row[m]['fraction_of_synchronous_bound']['median']:.2f}, of the paced one "
                f"{row[m]['fraction_of_paced_bound']['median']:.2f}" for m in ("cnn", "transformer")),
                flush=True)
    results["seconds"] = time.time() - started
    os.makedirs(args.out, exist_ok=True)
    for row in results["links"].values():
        row["run"] = {k: results["environment"][k] for k in ("date", "machine")}
    try:  # Links not run this time keep their last rows, with the run that wrote them.
        with open(os.path.join(args.out, "scaling.json")) as f:
            last = json.load(f)
        for row in last["links"].values():
            row.setdefault("run", {k: last["environment"][k] for k in ("date", "machine")})
        results["links"] = {link: results["links"].get(link) or last["links"][link]
                            for link in LINKS if link in results["links"] or link in last["links"]}
    except (OSError, ValueError, KeyError):
        pass
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "scaling.png"))
    print(f"wrote {os.path.join(args.out, 'scaling.json')} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
