"""`make bench-data`: the input pipeline at two dataset sizes, 2 workers, against plain TFRecord.

    python benchmarks/data.py [--sizes_gb=1,4] [--reps=3] [--dir=/var/tmp/distrib_tf_bench_data]

For each size it writes the same synthetic examples (64x64x3 uint8, 12 KiB, 10 classes)
twice, once prepared as ArrayRecord (`distrib_tf.data.records`) and once as TFRecord files,
then runs 2 worker processes at once (input pipelines 0 and 1 of 2, global batch 256), each
alone and interleaved with the other side, `--reps` times:

- `ours`: `distrib_tf.data.make_dataset_fn` (the order, random access, decoding in the
  graph): peak RSS of each worker, bytes it read (`rchar`), seconds to its first batch at
  step 10 and at step 100,000 (medians of 5 each, alternately, after a first pipeline),
  examples/s over `--steps` batches after 10 warm-up ones;
- `tfrecord`: `TFRecordDataset(own half of the files, num_parallel_reads=AUTOTUNE)
  .map(parse).batch(128).prefetch(AUTOTUNE)`, the same share, no shuffle: its examples/s.

Both sides read from the page cache (each file is read once before the runs). Writes
`data.json` with min, median and max of every figure.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from run import ENV  # noqa: E402
from run import environment  # noqa: E402
from run import spread  # noqa: E402

SHAPE = (64, 64, 3)
RECORD = 64 * 64 * 3 + 8
GLOBAL_BATCH = 256
NEAR_STEP, FAR_STEP = 10, 100_000


def _rchar() -> int:
    with open("/proc/self/io", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def generate(directory: str, gigabytes: float) -> dict:
    """The same examples as ArrayRecord (prepared) and as TFRecord files; reused when present."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from distrib_tf.data import prepare  # pylint: disable=import-outside-toplevel
    from distrib_tf.data import records  # pylint: disable=import-outside-toplevel
    from distrib_tf.data import registry  # pylint: disable=import-outside-toplevel

    count = int(gigabytes * 2**30 / RECORD)
    done = os.path.join(directory, "done.json")
    if os.path.exists(done):
        with open(done, encoding="utf-8") as f:
            if json.load(f)["count"] == count:
                return {"count": count, "dir": directory}
    ours, theirs = os.path.join(directory, "array_record"), os.path.join(directory, "tfrecord")
    os.makedirs(ours, exist_ok=True)
    os.makedirs(theirs, exist_ok=True)
    rng = np.random.default_rng(0)
    counts = {"train": count, "test": 1024}
    files = {}
    for split, total in counts.items():
        shards = 16 if split == "train" else 1
        writer = records.ShardWriter(ours, split, shards)
        tf_writers = [tf.io.TFRecordWriter(os.path.join(theirs, f"{split}-{i:05d}.tfrecord")) for i in range(shards)]
        for start in range(0, total, 1024):
            x = rng.integers(0, 256, size=(min(1024, total - start), *SHAPE), dtype=np.uint8)
            y = rng.integers(0, 10, size=len(x))
            for i, (row, label) in enumerate(zip(x, y)):
                shard = records.shard_of(start + i, total, shards)
                record = prepare.tensor_record(row, label)
                writer.write(record, shard)
                tf_writers[shard].write(record)  # The same bytes: parsed the same way on both sides.
        files[split] = writer.close()
        for w in tf_writers:
            w.close()
    info = registry.DatasetInfo("synthetic", "image", 10, SHAPE, num_examples=counts)
    records.write_meta(ours, {**prepare.meta_of(info, files, encoding="tensor", dtype="uint8"),
                              "format": "array_record"})
    with open(done, "w", encoding="utf-8") as f:
        json.dump({"count": count}, f)
    return {"count": count, "dir": directory}


def worker(args) -> dict:
    """One worker's figures, printed as one JSON line."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from distrib_tf import data  # pylint: disable=import-outside-toplevel

    context = tf.distribute.InputContext(2, args.index, 2)
    out = {}
    if args.mode == "ours":
        info = data.load_info(f"array_record:{os.path.join(args.dir, 'array_record')}")
        # A pipeline built and read once first (TensorFlow's one-time costs), then 5 at each
        # step, alternately: the same work but the step. Each figure is this worker's median.
        seconds = {0: [], NEAR_STEP: [], FAR_STEP: []}
        for step in (0, *(NEAR_STEP, FAR_STEP) * 5):
            started = time.perf_counter()
            dataset = data.make_dataset_fn(info, "train", global_batch_size=GLOBAL_BATCH, start_step=step)(context)
            iterator = iter(dataset)
            next(iterator)
            seconds[step].append(time.perf_counter() - started)
        for step, values in seconds.items():
            out[f"first_batch_seconds_at_{step}"] = statistics.median(values)
    else:
        def parse(records):  # What our reader does with the same bytes.
            raw = tf.reshape(tf.io.decode_raw(tf.strings.substr(records, 0, RECORD - 8), tf.uint8), [-1, *SHAPE])
            labels = tf.io.decode_raw(tf.strings.substr(records, RECORD - 8, 8), tf.int64)
            return tf.cast(raw, tf.float32) / 255.0, tf.reshape(labels, [-1])

        folder = os.path.join(args.dir, "tfrecord")
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("train-"))
        dataset = (tf.data.TFRecordDataset(files[args.index::2], num_parallel_reads=tf.data.AUTOTUNE)
                   .repeat().batch(GLOBAL_BATCH // 2).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
                   .prefetch(tf.data.AUTOTUNE))
        iterator = iter(dataset)
    rchar = _rchar()  # The bytes read from here on: the timed batches, their warm-up and prefetching.
    for _ in range(10):
        next(iterator)
    started = time.perf_counter()
    for _ in range(args.steps):
        next(iterator)
    out["examples_per_second"] = args.steps * GLOBAL_BATCH / 2 / (time.perf_counter() - started)
    with open("/proc/self/status", encoding="utf-8") as f:  # VmHWM: ru_maxrss keeps the parent's across exec.
        out["peak_rss_bytes"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    out["bytes_read"] = _rchar() - rchar
    served = (args.steps + 10) * GLOBAL_BATCH // 2
    out["bytes_read_per_byte_served"] = out["bytes_read"] / (served * RECORD)
    return out


def _warm(directory: str) -> None:
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(1 << 24):
                    pass


def run_pair(mode: str, directory: str, steps: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"--mode={mode}", f"--index={i}",
                               f"--dir={directory}", f"--steps={steps}"], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        if proc.returncode:
            sys.exit(f"benchmarks/data.py: a {mode} worker failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_gb", default="1,4", help="dataset sizes in GiB")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per side")
    parser.add_argument("--steps", type=int, default=300, help="batches timed per worker")
    parser.add_argument("--dir", default="/var/tmp/distrib_tf_bench_data", help="where the datasets are written")
    parser.add_argument("--out", default=os.path.join(HERE, "data.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["ours", "tfrecord"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    started, results = time.time(), {"environment": environment(), "reps": args.reps, "steps": args.steps,
                                     "record_bytes": RECORD, "global_batch_size": GLOBAL_BATCH, "sizes": {}}
    for size in (float(s) for s in args.sizes_gb.split(",")):
        directory = os.path.join(args.dir, f"{size:g}gb")
        dataset = generate(directory, size)
        _warm(directory)
        runs = {"ours": [], "tfrecord": []}
        for rep in range(args.reps):
            for mode in (("ours", "tfrecord") if rep % 2 == 0 else ("tfrecord", "ours")):
                runs[mode] += run_pair(mode, directory, args.steps)
        train_bytes = dataset["count"] * RECORD
        figures = {"examples": dataset["count"], "train_bytes": train_bytes,
                   "bytes_read_fraction_of_split": spread(r["bytes_read"] / train_bytes for r in runs["ours"])}
        for key in ("peak_rss_bytes", "bytes_read", "bytes_read_per_byte_served", "examples_per_second",
                    f"first_batch_seconds_at_{FAR_STEP}", f"first_batch_seconds_at_{NEAR_STEP}"):
            figures[key] = spread(r[key] for r in runs["ours"])
        figures["tfrecord_examples_per_second"] = spread(r["examples_per_second"] for r in runs["tfrecord"])
        figures["tfrecord_peak_rss_bytes"] = spread(r["peak_rss_bytes"] for r in runs["tfrecord"])
        figures["throughput_ratio"] = spread(  # Worker by worker, run by run: the same share on both sides.
            a["examples_per_second"] / b["examples_per_second"] for a, b in zip(runs["ours"], runs["tfrecord"]))
        figures["resume_ratio"] = spread(
            r[f"first_batch_seconds_at_{FAR_STEP}"] / r[f"first_batch_seconds_at_{NEAR_STEP}"] for r in runs["ours"])
        results["sizes"][f"{size:g}"] = figures
        print(f"{size:g} GiB: ours {figures['examples_per_second']['median']:.0f} examples/s per worker, "
              f"TFRecord {figures['tfrecord_examples_per_second']['median']:.0f} "
              f"(ratio {figures['throughput_ratio']['median']:.3f}); peak RSS "
              f"{figures['peak_rss_bytes']['median'] / 2**20:.0f} MiB; read "
              f"{figures['bytes_read']['median'] / 2**20:.0f} MiB of {train_bytes / 2**20:.0f}; first batch "
              f"{figures[f'first_batch_seconds_at_{NEAR_STEP}']['median']:.3f} s at step {NEAR_STEP}, "
              f"{figures[f'first_batch_seconds_at_{FAR_STEP}']['median']:.3f} s at step {FAR_STEP}", flush=True)
    sizes = list(results["sizes"].values())
    if len(sizes) > 1:
        results["rss_growth_bytes"] = sizes[-1]["peak_rss_bytes"]["median"] - sizes[0]["peak_rss_bytes"]["median"]
    results["seconds"] = time.time() - started
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
