"""`make bench-overhead`: what each of distrib_tf's per-step additions costs, one at a time.

    python benchmarks/overhead.py [--tiny] [--reps=3] [--models=cnn,transformer] [--out=DIR]

The main job on 2 local workers (hand-set TF_CONFIG on 127.0.0.1), each pinned to a core
of its own with one intra-op and one inter-op thread, so that the two do not compete.
Each run switches off one of our additions, in this same program, by replacing it before
the job starts (`--worker` mode below):

- `full`: the main job as users run it;
- `no_step_timing`: the per-worker step timing inside the step (the straggler watch);
- `no_progress`: the whole `Progress` callback (step timing, its exchange, events);
- `no_finite_check`: `StopOnNonFinite`, the per-step finiteness check;
- `no_culprit_metric`: the `NonFiniteReplicas` metric (one more logged value per step);
- `no_logs_in_gradients`: the step's logs all-reduced in a pack of their own, after the
  gradients' (two collectives a step, as before `distrib_tf.keras.step_logs`);
- `none_of_ours`: all of the above at once;
- `full_packed_<N>k`: the main job with its gradients all-reduced in packs of about N KiB,
  last layers first, so that a pack can travel while the backward pass goes on
  (`make_strategy(bytes_per_pack=...)`; the main job's default is one pack).

(`overhead.before.json` also has `no_normalization_collectives`, the CNN's synchronized
BatchNormalization unsynchronized: the CNN now normalizes per example and has none.)

Runs are interleaved (each rep rotates the order of the variants), `--reps` times; the
figure is the median training-step time (first epoch left out, the same timer as
`make bench`'s P1) and its ratio to `none_of_ours` of the same rep. Writes `overhead.json`.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from run import environment  # noqa: E402
from run import spread  # noqa: E402

from distrib_tf.cluster import ClusterSpec  # noqa: E402  (no TensorFlow here)

PY = sys.executable
PINNED = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
          "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
ADDITIONS = ("step_timing", "progress", "finite_check", "culprit_metric", "logs_in_gradients")
VARIANTS = {"full": (), **{f"no_{name}": (name,) for name in ADDITIONS}, "none_of_ours": ADDITIONS,
            "full_packed_16k": ("pack=16384",), "full_packed_64k": ("pack=65536",)}


def switch_off(names) -> None:
    """Replaces each named addition of the main job by nothing (in this process); `pack=N`
    makes the strategy all-reduce gradients in packs of N bytes."""
    # pylint: disable=import-outside-toplevel
    import keras

    from distrib_tf.keras import nonfinite
    from distrib_tf.keras import progress
    from distrib_tf.keras import step_logs
    from distrib_tf.run import run

    class Nothing(keras.callbacks.Callback):
        def __init__(self, *args, **kwargs):
            super().__init__()

    for name in names:
        if name.startswith("pack="):
            run.make_strategy = functools.partial(run.make_strategy, bytes_per_pack=int(name[5:]))
    if "progress" in names:
        progress.Progress = Nothing
    elif "step_timing" in names:
        progress.Progress._instrument_step = lambda self: None  # pylint: disable=protected-access
    if "finite_check" in names:
        nonfinite.StopOnNonFinite = Nothing
    if "logs_in_gradients" in names:
        step_logs.carry = lambda model: False
    if "culprit_metric" in names:  # StopOnNonFinite then checks the weights in a function of its own.
        nonfinite.attach = lambda model: None


def run_variant(scratch, model, variant, *, epochs, steps, tag) -> float:
    """Median training-step seconds of one run of the main job on 2 pinned local workers."""
    spec = ClusterSpec.local_workers(2).with_free_ports()
    out = f"{scratch}/{tag}"
    command = [PY, os.path.abspath(__file__), "--worker", ",".join(VARIANTS[variant]),
               f"--model={model}", f"--epochs={epochs}", f"--steps_per_epoch={steps}",
               "--global_batch_size=64", f"--model_dir={out}"]
    procs = [subprocess.Popen(["taskset", "-c", str(i % (os.cpu_count() or 1)), *command],
                              env={**os.environ, **PINNED, "TF_CONFIG": spec.tf_config(task)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, task in enumerate(spec.tasks)]
    for proc in procs:
        output = proc.communicate(timeout=900)[0]
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{output[-3000:]}")
    with open(f"{out}/summary.json") as f:
        record = json.load(f)
    return statistics.median(record["epoch_step_seconds"][1:]) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which of: " + ", ".join(VARIANTS))
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args(argv)
    reps = 1 if args.tiny else args.reps
    epochs, steps = (2, 3) if args.tiny else (3, 40)
    variants = ["full", "none_of_ours"] if args.tiny else args.variants.split(",")
    if "none_of_ours" not in variants:
        variants.append("none_of_ours")  # The baseline of every ratio.
    started = time.time()
    results = {"environment": environment(), "reps": reps,
               "setup": f"2 workers pinned to a core each, global batch 64, {epochs} epochs of {steps} steps, "
                        "first epoch left out", "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            seconds = {variant: [] for variant in variants}
            for rep in range(reps):
                order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                for variant in order:
                    seconds[variant].append(run_variant(scratch, model, variant, epochs=epochs, steps=steps,
                                                        tag=f"{model}_{variant}_{rep}"))
            base = seconds["none_of_ours"]
            results["models"][model] = {
                variant: {"step_seconds": spread(values),
                          "ratio_to_none_of_ours": spread(v / b for v, b in zip(values, base))}
                for variant, values in seconds.items()}
            for variant, row in results["models"][model].items():
                print(f"{model} {variant:32s} {1000 * row['step_seconds']['median']:7.1f} ms  "
                      f"x{row['ratio_to_none_of_ours']['median']:.3f} "
                      f"[{row['ratio_to_none_of_ours']['min']:.3f}, {row['ratio_to_none_of_ours']['max']:.3f}]",
                      flush=True)
    results["seconds"] = time.time() - started
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'overhead.json')} in {results['seconds']:.0f} s")


def worker(argv):
    """`--worker OFF [flags...]`: the main job's command line with the additions OFF switched off."""
    switch_off([name for name in argv[0].split(",") if name])
    sys.argv = [sys.argv[0], *argv[1:]]
    from distrib_tf.train import cli  # pylint: disable=import-outside-toplevel
    cli.run()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
