"""Markdown tables from the JSON the benchmarks wrote (what BENCHMARKS.md quotes).

    python benchmarks/report.py [DIR]     # DIR: where the benchmarks' JSON files are

Prints every figure as median (min-max) over its repetitions; nothing is computed here
that the JSON does not hold but ratios of its medians, named as such.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(value, digits=3) -> str:
    return f"{value['median']:.{digits}f} ({value['min']:.{digits}f}–{value['max']:.{digits}f})"


RATIOS = [
    ("p1_step_time_ratio", "≤ 1.02", "P1: training-step time, distrib_tf / hand-written"),
    ("p1_wall_per_epoch_ratio", "—", "P1: wall time per epoch (validation, backups, checkpoints on our side)"),
    ("p2_pipeline_ratio_cnn", "≤ 1.05", "P2: step time, real pipeline / one cached batch, CNN, 2 workers"),
    ("p2_pipeline_ratio_transformer", "≤ 1.05", "P2: the same, transformer"),
    ("p2_pipeline_ratio_cnn_streamed", "≤ 1.05", "P2: the same, CNN on shapes read from ArrayRecord shards"),
    ("p4_first_step_ratio", "≤ 1.1", "P4: seconds to the first step, launcher / by hand"),
    ("p4_total_ratio", "≤ 1.1", "P4: seconds to the end, launcher / by hand"),
]


def bench_tables(results, previous) -> list[str]:
    env = results["environment"]
    lines = [f"Run of {env['date']}: {env['machine']}; TensorFlow {env['tensorflow']}, Keras {env['keras']}, "
             f"Python {env['python']}; {results['reps']} repetitions per side, {results['seconds']:.0f} s.", "",
             "| figure | this run | previous run | goal | what |", "| --- | --- | --- | --- | --- |"]
    for key, goal, what in RATIOS:
        before = fmt(previous[key]) if previous and key in previous else "—"
        now = fmt(results[key]) if key in results else "—"
        lines.append(f"| `{key}` | {now} | {before} | {goal} | {what} |")
    lines += ["", "| side | P1 step seconds | P1 wall seconds per epoch | P4 s to first step | P4 s total |",
              "| --- | --- | --- | --- | --- |"]
    for ours, theirs, label in (("distrib_tf", "launcher", "distrib_tf / launcher"),
                                ("hand_written", "by_hand", "hand-written / by hand")):
        lines.append(f"| {label} | {fmt(results['p1_step_seconds'][ours], 4)} | "
                     f"{fmt(results['p1_wall_seconds_per_epoch'][ours], 2)} | "
                     f"{fmt(results['p4_seconds_to_first_step'][theirs], 2)} | "
                     f"{fmt(results['p4_seconds_total'][theirs], 2)} |")
    ceiling = results["p3_ceiling_bytes_per_second"]
    lines += ["", f"P3: ceiling `iperf3 --bidir` over loopback, each way: {ceiling['median'] / 1e6:.0f} MB/s "
              f"({ceiling['min'] / 1e6:.0f}–{ceiling['max'] / 1e6:.0f}).", "",
              "| MB reduced | bus bandwidth, MB/s | fraction of the ceiling |", "| --- | --- | --- |"]
    for size, row in results["p3_allreduce"].items():
        bus = {k: v / 1e6 for k, v in row["bus_bytes_per_second"].items() if k != "values"}
        lines.append(f"| {size} | {fmt(bus, 0)} | {fmt(row['fraction_of_ceiling'])} |")
    return lines


def _ms(seconds) -> dict:
    return {k: v * 1e3 for k, v in seconds.items() if k != "values"}


def _step_ms(examples_per_second, batch=32) -> dict:
    """A worker's step in ms from its examples/s (min and max swap)."""
    step = {k: batch * 1e3 / v for k, v in examples_per_second.items() if k != "values"}
    step["min"], step["max"] = step["max"], step["min"]
    return step


def scaling_tables(scaling) -> list[str]:
    lines = [f"Run of {scaling['environment']['date']}, {scaling['reps']} repetitions per cell, "
             f"{scaling['seconds']:.0f} s.", "",
             "| link | run | iperf3 each way, MB/s | model | 1 worker, examples/s | 2 workers, examples/s "
             "| efficiency |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for link, row in scaling["links"].items():
        iperf = {k: v / 1e6 for k, v in row["iperf3_bidir_bytes_per_second"].items() if k != "values"}
        run = row.get("run") or scaling["environment"]
        where = f"{run['date'][:16]}, {run['machine'].split(', ')[1]}"
        for model in ("cnn", "transformer"):
            cell = row[model]
            lines.append(f"| {link} | {where} | {fmt(iperf, 0)} | {model} | "
                         f"{fmt(cell['one_worker_examples_per_second'], 0)} | "
                         f"{fmt(cell['two_workers_examples_per_second'], 0)} | {fmt(cell['efficiency'], 2)} |")
    bounded = [(link, row) for link, row in scaling["links"].items() if "bound" in row["cnn"]]
    if bounded:
        lines += ["", "The bound: the step's collectives alone between the same pinned processes, and our efficiency "
                  "as a fraction of the efficiency they allow:", "",
                  "| link | model | one worker's step, ms | collectives alone, ms | gradient MB | bound (TF's) "
                  "| efficiency | fraction of the bound | link's bound |", "| --- |" + " --- |" * 8]
        for link, row in bounded:
            for model in ("cnn", "transformer"):
                cell = row[model]
                step, ms = _step_ms(cell["one_worker_examples_per_second"]), _ms(cell["collectives_step_seconds"])
                lines.append(f"| {link} | {model} | {fmt(step, 1)} | {fmt(ms, 1)} | {cell['gradient_bytes'] / 1e6:.2f} "
                             f"| {fmt(cell['bound'], 2)} | {fmt(cell['efficiency'], 2)} | "
                             f"{fmt(cell['fraction_of_bound'], 2)} | {fmt(cell['link_bound'], 2)} |")
    split = [(link, row) for link, row in bounded if "two_workers_collective_seconds" in row["cnn"]]
    if split:
        lines += ["", "Where the two workers' step goes (medians over their steps, `step_times.py`), against a worker "
                  "alone, two single workers side by side (no communication) and the collectives alone; the "
                  "machine's bound:", "",
                  "| link | model | alone, ms | side by side, ms | two: step, ms | own step, ms | wait, ms "
                  "| of which the collective, ms | of which the other worker, ms | collectives alone, ms "
                  "| machine's bound | fraction of it |", "| --- |" + " --- |" * 11]
        synchronous = [(link, row) for link, row in split if "synchronous_bound" in row["cnn"]]
        for link, row in split:
            for model in ("cnn", "transformer"):
                cell = row[model]
                parts = " | ".join(fmt(_ms(cell[f"two_workers_{part}_seconds"]), 1)
                                   for part in ("wall", "own", "wait", "collective", "peer"))
                lines.append(f"| {link} | {model} | {fmt(_step_ms(cell['one_worker_examples_per_second']), 1)} | "
                             f"{fmt(_step_ms(cell['side_by_side_examples_per_second']), 1)} | {parts} | "
                             f"{fmt(_ms(cell['collectives_step_seconds']), 1)} | {fmt(cell['machine_bound'], 2)} | "
                             f"{fmt(cell['fraction_of_machine_bound'], 2)} |")
        if synchronous:
            paced = all("paced_bound" in row["cnn"] for _, row in synchronous)
            lines += ["", "This machine's synchronous bound: beside the side-by-side step, what waiting for the "
                      "slower of those two workers would add to a step (`straggler`, the mean of |a - b| / 2 over "
                      "every pair of their steps), against what the two workers waited for each other"
                      + ("; and the same bound with the collectives paced, each after a computation as long "
                         "as a step:" if paced else ":"), "",
                      "| link | model | side by side, ms | straggler, ms | the other worker in the two's wait, ms "
                      "| collectives alone, ms | synchronous bound | efficiency | fraction of it |"
                      + (" collectives paced, ms | paced bound | fraction of it |" if paced else ""),
                      "| --- |" + " --- |" * (11 if paced else 8)]
            for link, row in synchronous:
                for model in ("cnn", "transformer"):
                    cell = row[model]
                    lines.append(f"| {link} | {model} | {fmt(_step_ms(cell['side_by_side_examples_per_second']), 1)} | "
                                 f"{fmt(_ms(cell['side_by_side_straggler_seconds']), 1)} | "
                                 f"{fmt(_ms(cell['two_workers_peer_seconds']), 1)} | "
                                 f"{fmt(_ms(cell['collectives_step_seconds']), 1)} | "
                                 f"{fmt(cell['synchronous_bound'], 2)} | {fmt(cell['efficiency'], 2)} | "
                                 f"{fmt(cell['fraction_of_synchronous_bound'], 2)} |"
                                 + (f" {fmt(_ms(cell['paced_collectives_step_seconds']), 1)} | "
                                    f"{fmt(cell['paced_bound'], 2)} | {fmt(cell['fraction_of_paced_bound'], 2)} |"
                                    if paced else ""))
    apart = [(link, row) for link, row in bounded if "efficiency_logs_apart" in row["cnn"]]
    if apart:
        lines += ["", "One collective a step (the logs in the gradients' pack) against two (the logs apart, as "
                  "before), in the same run:", "",
                  "| link | model | 2 workers, examples/s | logs apart: 2 workers, examples/s | efficiency "
                  "| logs apart: efficiency |", "| --- |" + " --- |" * 5]
        for link, row in apart:
            for model in ("cnn", "transformer"):
                cell = row[model]
                lines.append(f"| {link} | {model} | {fmt(cell['two_workers_examples_per_second'], 0)} | "
                             f"{fmt(cell['two_workers_logs_apart_examples_per_second'], 0)} | "
                             f"{fmt(cell['efficiency'], 2)} | {fmt(cell['efficiency_logs_apart'], 2)} |")
    sizes = list(next(iter(scaling["links"].values()))["allreduce"])
    lines += ["", "All-reduce bus bandwidth / shaped rate:", "",
              "| link | " + " | ".join(f"{s} MB" for s in sizes) + " |", "| --- |" + " --- |" * len(sizes)]
    for link, row in scaling["links"].items():
        lines.append(f"| {link} | " + " | ".join(fmt(row["allreduce"][s]["fraction_of_link"], 2) for s in sizes) + " |")
    return lines


def sync_tables(sync) -> list[str]:
    lines = [f"{sync['epochs']} epochs per run, one run per cell.", ""]
    for model, links in sync["models"].items():
        for link, rows in links.items():
            run = sync["links"][link]
            step = rows["step"]["seconds_to_target"]
            lines += [f"{model}, {link}, target test accuracy {sync['targets'][model]} (run of "
                      f"{run['environment']['date']}, {run['seconds']:.0f} s for both models):", "",
                      "| setting | s to target | × faster than step | final accuracy | wall s, all epochs "
                      "| MB sent per worker |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for name, row in rows.items():
                reached = row["seconds_to_target"]
                speedup = f"{step / reached:.2f}" if reached and step else "—"
                lines.append(f"| {name} | {f'{reached:.1f}' if reached else 'not reached'} | {speedup} | "
                             f"{row['final_accuracy']:.4f} | {row['wall_seconds']:.1f} | "
                             f"{row['bytes_sent_per_worker'] / 1e6:.1f} |")
            lines.append("")
    return lines


def data_tables(bench) -> list[str]:
    mib = lambda v: {k: x / 2**20 for k, x in v.items() if k != "values"}  # noqa: E731
    lines = [f"Run of {bench['environment']['date']}: {bench['environment']['machine']}; {bench['reps']} "
             f"repetitions per side, 2 workers each, {bench['steps']} batches of {bench['global_batch_size'] // 2} "
             f"per worker, records of {bench['record_bytes']} bytes, page cache warm; {bench['seconds']:.0f} s.", "",
             "| dataset | peak RSS per worker, MiB | MiB read per worker (read / served) | first batch at step 10, s "
             "| at step 100,000, s "
             "| ratio | examples/s per worker | plain TFRecord | ours / TFRecord |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size, row in bench["sizes"].items():
        lines.append(f"| {size} GiB ({row['examples']} examples) | {fmt(mib(row['peak_rss_bytes']), 0)} | "
                     f"{fmt(mib(row['bytes_read']), 0)} ({row['bytes_read_per_byte_served']['median']:.2f}) | "
                     f"{fmt(row['first_batch_seconds_at_10'], 3)} | "
                     f"{fmt(row['first_batch_seconds_at_100000'], 3)} | {fmt(row['resume_ratio'], 2)} | "
                     f"{fmt(row['examples_per_second'], 0)} | {fmt(row['tfrecord_examples_per_second'], 0)} | "
                     f"{fmt(row['throughput_ratio'], 2)} |")
    if "rss_growth_bytes" in bench:
        lines += ["", f"Peak RSS growth from the smallest to the largest dataset (medians): "
                      f"{bench['rss_growth_bytes'] / 2**20:+.0f} MiB (goal: within +256 MiB)."]
    routes = [(size, row) for size, row in bench["sizes"].items() if "grain_examples_per_second" in row]
    if routes:
        lines += ["", "| dataset | route | examples/s per worker | / plain TFRecord | peak RSS per worker, MiB |",
                  "| --- | --- | --- | --- | --- |"]
        for size, row in routes:
            lines.append(f"| {size} GiB | ours (in the worker) | {fmt(row['examples_per_second'], 0)} | "
                         f"{fmt(row['throughput_ratio'], 2)} | {fmt(mib(row['peak_rss_bytes']), 0)} |")
            lines.append(f"| {size} GiB | Grain, {row['grain_processes']} child processes a worker | "
                         f"{fmt(row['grain_examples_per_second'], 0)} | {fmt(row['grain_throughput_ratio'], 2)} | "
                         f"{fmt(mib(row['grain_peak_rss_bytes']), 0)} (the worker's alone) |")
    if "grain_same_batches" in bench:
        lines += ["", "The Grain route gives the batches of `ours` byte for byte (pipeline 1 of 2): " + ", ".join(
            f"{steps} {'yes' if same else 'NO'}" for steps, same in bench["grain_same_batches"].items()) + "."]
    if "reads" in bench:
        lines += ["", "| one core, 128 random records of one shard a call | records/s |", "| --- | --- |"]
        lines += [f"| `{way}` | {rate:.0f} |" for way, rate in bench["reads"].items()]
    if "per_core" in bench:
        low, high = bench["per_core"]["cores"]
        figures = bench["per_core"]["examples_per_second"]
        lines += ["", f"| one worker alone, examples/s | on {low} core | on {high} cores | {high} / {low} |",
                  "| --- | --- | --- | --- |"]
        for mode in dict.fromkeys(key.split("@")[0] for key in figures):
            one, all_ = figures[f"{mode}@{low}"], figures[f"{mode}@{high}"]
            lines.append(f"| {mode} | {fmt(one, 0)} | {fmt(all_, 0)} | {all_['median'] / one['median']:.2f} |")
    return lines


def overhead_tables(after, before) -> list[str]:
    """Step time per variant; `before` (`overhead.before.json`, the same command on the
    code before the step lost its host calls) beside it when present."""
    lines = [f"Run of {after['environment']['date']}: {after['setup']}; {after['reps']} repetitions, "
             f"variants interleaved; {after['seconds']:.0f} s."]
    if before:
        lines[0] += f" Before: run of {before['environment']['date']}, same command and setup."
    lines += ["", "| model | variant | step, ms | / none_of_ours |"
              + (" before: step, ms | before: / none_of_ours |" if before else ""),
              "| --- | --- | --- | --- |" + (" --- | --- |" if before else "")]
    ms = lambda v: {k: 1000 * x for k, x in v.items() if k != "values"}  # noqa: E731
    for model, rows in after["models"].items():
        old = (before or {}).get("models", {}).get(model, {})
        for variant, row in rows.items():
            line = (f"| {model} | {variant} | {fmt(ms(row['step_seconds']), 1)} | "
                    f"{fmt(row['ratio_to_none_of_ours'], 3)} |")
            if before:
                was = old.get(variant)
                line += (f" {fmt(ms(was['step_seconds']), 1)} | {fmt(was['ratio_to_none_of_ours'], 3)} |"
                         if was else " — | — |")
            lines.append(line)
    return lines


def resize_tables(resize) -> list[str]:
    lines = [f"Run of {resize['environment']['date']}: {resize['environment']['machine']}; {resize['repeats']} "
             "repetitions, cases interleaved.", "",
             "| case | s from the launcher's start to the end of the first step | / the restart it is compared with |",
             "| --- | --- | --- |"]
    for name, row in resize["layouts"].items():
        ratio = f"{row['ratio_to_restart']:.2f} ({row['compared_with']})" if row.get("compared_with") else "—"
        lines.append(f"| {name} | {row['median']:.2f} ({row['min']:.2f}–{row['max']:.2f}) | {ratio} |")
    return lines


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else HERE
    results = _load(folder, "results.json")
    if results:
        print("\n".join(["## make bench", ""] + bench_tables(results, _load(folder, "results.previous.json")) + [""]))
    scaling = _load(folder, "scaling.json")
    if scaling:
        print("\n".join(["## make bench-scaling", ""] + scaling_tables(scaling) + [""]))
    bench_data = _load(folder, "data.json")
    if bench_data:
        print("\n".join(["## make bench-data", ""] + data_tables(bench_data) + [""]))
    before = _load(folder, "data.before.json")
    if before:
        print("\n".join(["Before (`data.before.json`):", ""] + data_tables(before) + [""]))
    overhead = _load(folder, "overhead.json")
    if overhead:
        print("\n".join(["## make bench-overhead", ""]
                        + overhead_tables(overhead, _load(folder, "overhead.before.json")) + [""]))
    resize = _load(folder, "resize.json")
    if resize and "environment" in resize:
        print("\n".join(["## make bench-resize", ""] + resize_tables(resize) + [""]))
    sync = _load(folder, "sync.json")
    if sync:
        print("\n".join(["## make bench-sync", ""] + sync_tables(sync)))


if __name__ == "__main__":
    main()
