"""`make bench-data`: the input pipeline at two dataset sizes, 2 workers, against plain TFRecord.

    python benchmarks/data.py [--sizes_gb=1,4] [--reps=3] [--grain] [--dir=/var/tmp/distrib_tf_bench_data]

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

- `grain` (`--grain`, needs the `bench` extra): the Grain route (`benchmarks/grain_route.py`):
  the same slices, read in `--grain_processes` child processes per worker; on the first size
  it is also checked to give the batches of `ours` byte for byte (pipeline 1, 6 steps from
  step 0 and from step 100,000).

Then, on the first size, the ways array_record reads records by index (`--mode=reads`,
one process pinned to one core, 128 random positions of one shard a call, 3 s each):
`read(positions)` as one call, and one record at a time as a range of one,
`read(p, p + 1)`, with 16 and 32 KiB file buffers. And per core: one worker alone (pipeline
0 of 2), pinned to 1 core and then given both, each side in turn, `--reps` times (the Grain
route with as many child processes as cores): how each side's examples/s grows with cores.

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


def same_batches(args) -> dict:
    """Whether the Grain route gives `make_dataset_fn`'s batches, byte for byte (pipeline 1 of 2)."""
    import grain_route  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from distrib_tf import data  # pylint: disable=import-outside-toplevel

    folder = os.path.join(args.dir, "array_record")
    info = data.load_info(f"array_record:{folder}")
    checked = {}
    for start in (0, FAR_STEP):
        ours = data.make_dataset_fn(info, "train", global_batch_size=GLOBAL_BATCH, start_step=start)(
            tf.distribute.InputContext(2, 1, 2))
        theirs = grain_route.dataset(folder, 1, GLOBAL_BATCH, SHAPE, processes=2, start_step=start)
        checked[f"steps {start}-{start + 5}"] = all(
            np.array_equal(a.numpy(), b.numpy()) for x, y in zip(ours.take(6), theirs.take(6)) for a, b in zip(x, y))
    return checked


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
    elif args.mode == "grain":
        import grain_route  # pylint: disable=import-outside-toplevel

        dataset = grain_route.dataset(os.path.join(args.dir, "array_record"), args.index, GLOBAL_BATCH, SHAPE,
                                      processes=args.grain_processes)
        iterator = iter(dataset)
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


def run_pair(mode: str, directory: str, steps: int, grain_processes: int, *, cores: int | None = None) -> list[dict]:
    """Workers 0 and 1 at once; or, with `cores`, worker 0 alone on that many cores."""
    pin = ["taskset", "-c", ",".join(str(c) for c in range(cores))] if cores else []
    procs = [subprocess.Popen([*pin, sys.executable, __file__, "--worker", f"--mode={mode}", f"--index={i}",
                               f"--dir={directory}", f"--steps={steps}", f"--grain_processes={grain_processes}"],
                              env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in ((0,) if cores else (0, 1))]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        if proc.returncode:
            sys.exit(f"benchmarks/data.py: a {mode} worker failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def reads(args) -> dict:
    """Records/s of each way to read 128 random records of one shard, in this process."""
    import glob  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel

    path = sorted(glob.glob(os.path.join(args.dir, "array_record", "train-*")))[0]
    ways = {"read(positions), 32 KiB buffer": (32768, lambda r, ps: r.read(ps)),
            "read(p, p + 1) each, 32 KiB buffer": (32768, lambda r, ps: [r.read(p, p + 1) for p in ps]),
            "read(p, p + 1) each, 16 KiB buffer": (16384, lambda r, ps: [r.read(p, p + 1) for p in ps])}
    out = {}
    for name, (buffer, read) in ways.items():
        reader = array_record_module.ArrayRecordReader(path, "readahead_buffer_size:0", file_reader_buffer_size=buffer)
        rng, count, started = np.random.default_rng(0), 0, time.perf_counter()
        while time.perf_counter() - started < 3:
            read(reader, rng.integers(0, reader.num_records(), 128).tolist())
            count += 128
        out[name] = count / (time.perf_counter() - started)
        reader.close()
    return out


def per_core(modes, directory: str, args) -> dict:
    """Examples/s of one worker alone on 1 core and on every core, each side in turn."""
    counts = (1, os.cpu_count())
    runs = {f"{mode}@{cores}": [] for mode in modes for cores in counts}
    for rep in range(args.reps):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            for cores in counts:
                runs[f"{mode}@{cores}"] += run_pair(mode, directory, args.steps, cores, cores=cores)
    figures = {key: spread(r["examples_per_second"] for r in values) for key, values in runs.items()}
    print("one worker alone, examples/s: " + "; ".join(
        f"{key.replace('@', ' on ')} cores {value['median']:.0f}" for key, value in figures.items()), flush=True)
    return {"cores": list(counts), "examples_per_second": figures}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_gb", default="1,4", help="dataset sizes in GiB")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per side")
    parser.add_argument("--steps", type=int, default=300, help="batches timed per worker")
    parser.add_argument("--dir", default="/var/tmp/distrib_tf_bench_data", help="where the datasets are written")
    parser.add_argument("--out", default=os.path.join(HERE, "data.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grain", action="store_true",
                        help="also the Grain route (benchmarks/grain_route.py; needs `pip install grain`)")
    parser.add_argument("--grain_processes", type=int, default=2, help="child processes per worker, Grain route")
    parser.add_argument("--mode", choices=["ours", "tfrecord", "grain", "reads", "same_batches"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps({"reads": reads, "same_batches": same_batches}.get(args.mode, worker)(args)))
        return
    started, results = time.time(), {"environment": environment(), "reps": args.reps, "steps": args.steps,
                                     "record_bytes": RECORD, "global_batch_size": GLOBAL_BATCH, "sizes": {}}
    for size in (float(s) for s in args.sizes_gb.split(",")):
        directory = os.path.join(args.dir, f"{size:g}gb")
        dataset = generate(directory, size)
        _warm(directory)
        modes = ("ours", "tfrecord", "grain") if args.grain else ("ours", "tfrecord")
        runs = {mode: [] for mode in modes}
        for rep in range(args.reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                runs[mode] += run_pair(mode, directory, args.steps, args.grain_processes)
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
        if args.grain:
            figures["grain_processes"] = args.grain_processes
            figures["grain_examples_per_second"] = spread(r["examples_per_second"] for r in runs["grain"])
            figures["grain_peak_rss_bytes"] = spread(r["peak_rss_bytes"] for r in runs["grain"])
            figures["grain_throughput_ratio"] = spread(
                a["examples_per_second"] / b["examples_per_second"] for a, b in zip(runs["grain"], runs["tfrecord"]))
            print(f"{size:g} GiB: Grain route ({args.grain_processes} processes a worker) "
                  f"{figures['grain_examples_per_second']['median']:.0f} examples/s per worker "
                  f"(ratio {figures['grain_throughput_ratio']['median']:.3f})", flush=True)
        results["sizes"][f"{size:g}"] = figures
        if "per_core" not in results:
            results["reads"] = run_pair("reads", directory, args.steps, 0, cores=1)[0]
            print("records/s on one core: " + "; ".join(f"{k} {v:.0f}" for k, v in results["reads"].items()),
                  flush=True)
            results["per_core"] = per_core(modes, directory, args)
            if args.grain:
                results["grain_same_batches"] = run_pair("same_batches", directory, args.steps, 0, cores=2)[0]
                print(f"Grain route, the same batches as ours: {results['grain_same_batches']}", flush=True)
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
