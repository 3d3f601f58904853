"""How far apart layouts end, in float32 and in float64: `make bench-layout`.

Runs the main job as the layout test does (2 epochs of 6 steps, global batch 64) in one
process, on 2 and on 4 logical replicas, in float32 and in float64, plus a control: the
one-process float32 run with oneDNN off, whose kernels sum in another order but whose
layout is the same. Prints the relative L2 distance of the final weights between every
pair of one precision and writes them to `benchmarks/layout_gap.json`.

Reading it: a distance that is as large for the control as between layouts is rounding,
not layout; in float64 a real layout difference would stay and rounding would shrink to
about 1e-15.
"""

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # The layout test's own checkpoint readers.
from cluster_runner import checkpoint_arrays  # noqa: E402
from cluster_runner import weights_difference  # noqa: E402

RUNS = {  # name: (flags, extra environment)
    "1 replica": (["--strategy=one_device"], {}),
    "1 replica, oneDNN off": (["--strategy=one_device"], {"TF_ENABLE_ONEDNN_OPTS": "0"}),
    "2 replicas": (["--cpu_replicas=2"], {}),
    "4 replicas": (["--cpu_replicas=4"], {}),
}


def run(model: str, flags: list[str], env: dict, model_dir: pathlib.Path) -> dict:
    argv = [sys.executable, "-m", "distrib_tf.train", f"--model={model}", "--epochs=2",
            "--steps_per_epoch=6", "--global_batch_size=64", f"--model_dir={model_dir}", *flags]
    subprocess.run(argv, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return checkpoint_arrays(model_dir / "checkpoints" / "epoch002.weights.h5")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,transformer", help="Comma-separated models.")
    parser.add_argument("--out", default=str(HERE / "layout_gap.json"), help="JSON to write.")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            for precision in ("float32", "float64"):
                extra = ["--float64"] if precision == "float64" else []
                weights = {name: run(model, [*flags, *extra], env, pathlib.Path(scratch) / f"{model}{precision}{i}")
                           for i, (name, (flags, env)) in enumerate(RUNS.items())}
                for a, b in itertools.combinations(weights, 2):
                    distance = weights_difference(weights[a], weights[b])
                    results.append({"model": model, "precision": precision, "a": a, "b": b,
                                    "relative_distance": distance})
                    print(f"{model:11s} {precision}  {a:22s} vs {b:22s} {distance:.1e}", flush=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
