"""Keras's own tests of `fit` as the contract of `distrib_tf.Run` (`make test-keras`).

Runs the tests of Keras's trainer, callbacks and models (`keras/src/trainers/`,
`callbacks/`, `models/`, from the installed Keras's sdist: `fetch.py`) with a live `Run`
on one device and with a live `Run` on 2 replicas (`MirroredStrategy` over 2 logical
CPUs), each over `--jobs` processes (pytest-xdist, `plugin.py`); then plainly, on the
same layout, the tests that failed with the run (the only ones whose plain outcome can
make a gap or keep a refusal). A test that passes plainly and fails with the run, on the
same layout, is a gap in the contract; the command fails on any gap that `refusals.txt`
does not list, and names the listed ones that pass now (to be taken off the list). Tests
that fail plainly too (a missing optional package: orbax, grain, torch; Keras's own limits
under a strategy) say nothing of the run.

Usage:

    python tests/keras_contract/contract.py                 # both layouts
    python tests/keras_contract/contract.py --layouts=one   # one device only
    python tests/keras_contract/contract.py -k EarlyStopping --layouts=two

Writes each variant's outcomes (`<variant>.json`; a plain variant's holds the tests it
ran) and the gap (`gap.md`: test, layout, the error's line) under `--out` (default
`.keras-contract/results/`). Exit code 0: no unlisted gap; 1: a gap; 2: a variant's
process failed to run its tests.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fetch  # noqa: E402  pylint: disable=wrong-import-position

LAYOUTS = {"one": ("plain", "run"), "two": ("plain-mirrored", "run-mirrored")}
REFUSALS = os.path.join(HERE, "refusals.txt")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="one,two", help="comma-separated: one (one device), two (2 replicas)")
    parser.add_argument("--cache", default=fetch.DEFAULT_CACHE, help="where the sdist's tests are unpacked")
    parser.add_argument("--out", default=None, help="results directory (default: CACHE/results)")
    parser.add_argument("--jobs", type=int, default=2, help="processes a variant runs its tests in (pytest-xdist)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a variant may take")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k, to run a selection")
    parser.add_argument("--compare_only", action="store_true", help="compare the results in --out again")
    args = parser.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        parser.error(f"Invalid value for `--layouts`. Received: {args.layouts!r}. Expected a comma-separated "
                     f"subset of {sorted(LAYOUTS)}.")
    args.layouts = layouts
    return args


def load_refusals(path: str = REFUSALS) -> dict:
    """`refusals.txt` as {(layout, test id): reason}: lines `LAYOUT TEST_ID -- REASON`,
    LAYOUT `one`, `two` or `both`; `#` starts a comment (a group's heading)."""
    refusals = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head, sep, reason = line.partition(" -- ")
            parts = head.split()
            if not sep or len(parts) != 2 or parts[0] not in ("one", "two", "both") or not reason.strip():
                raise ValueError(f"Invalid line {number} in {path}. Received: {line!r}. "
                                 "Expected `one|two|both TEST_ID -- one-line reason`.")
            for layout in (("one", "two") if parts[0] == "both" else (parts[0],)):
                refusals[(layout, parts[1])] = reason.strip()
    return refusals


def run_variant(variant: str, tests_dir: str, out: str, *, keyword=None, only=None, jobs: int = 1,
                timeout: float) -> tuple[dict, float]:
    """One pytest run over Keras's tests (or over the test ids `only`) in `jobs` processes;
    returns its outcomes and its minutes."""
    results = os.path.join(out, f"{variant}.json")
    log = os.path.join(out, f"{variant}.log")
    if os.path.exists(results):
        os.remove(results)
    env = dict(os.environ, DISTRIB_TF_CONTRACT_VARIANT=variant, DISTRIB_TF_CONTRACT_RESULTS=results,
               KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("DISTRIB_TF_CONTRACT_ONLY", None)
    paths = [os.path.join(tests_dir, d) for d in fetch.DIRECTORIES]
    if only is not None:
        if not only:  # Nothing to run: no process.
            with open(results, "w", encoding="utf-8") as f:
                json.dump({}, f)
            return {}, 0.0
        env["DISTRIB_TF_CONTRACT_ONLY"] = os.path.join(out, f"{variant}.ids")
        with open(env["DISTRIB_TF_CONTRACT_ONLY"], "w", encoding="utf-8") as f:
            f.write("".join(f"{test}\n" for test in only))
        paths = [os.path.join(tests_dir, path) for path in files_of(only)]
    command = [sys.executable, "-m", "pytest", "-q", "--durations=25", "-p", "plugin", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", "-c", os.path.join(HERE, "pytest.ini"),
               f"--rootdir={tests_dir}", "--import-mode=importlib", *(["-n", str(jobs)] if jobs > 1 else []),
               *(["-k", keyword] if keyword else []), *paths]
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False).returncode
    minutes = (time.monotonic() - start) / 60
    if code not in (0, 1) or not os.path.exists(results):  # 1: some tests failed, as expected.
        raise RuntimeError(f"The {variant} variant exited {code} without its results; see {log}.")
    with open(results, encoding="utf-8") as f:
        return json.load(f), minutes


def plain_needed(run: dict) -> list:
    """The tests to run plainly: those that failed with the run. A test that passes (or is
    skipped) with the run is in no gap, and a refusal of it is stale, whatever it does
    plainly; a test that fails with the run is a gap, or keeps its refusal, if it passes plainly."""
    return sorted(test for test, entry in run.items() if entry["outcome"] == "failed")


def files_of(tests) -> list:
    """The test files (`keras/src/x/y_test.py`) of test ids, in order, once each."""
    return list(dict.fromkeys(test.split("::")[0] for test in tests))


def gap_of(plain: dict, run: dict) -> dict:
    """{test id: the run's error} for the tests that pass plainly and fail with the run."""
    return {test: run[test]["error"] for test, entry in plain.items()
            if entry["outcome"] == "passed" and run.get(test, {}).get("outcome") == "failed"}


def counts(results: dict) -> str:
    outcome = [entry["outcome"] for entry in results.values()]
    routed = sum(1 for entry in results.values() if entry.get("routed_fits"))
    return (f"{outcome.count('passed')} passed, {outcome.count('failed')} failed, {outcome.count('skipped')} "
            f"skipped" + (f"; {routed} tests' fit went through Run.fit" if routed else ""))


def stale_of(refusals: dict, layout: str, run: dict, gap: dict) -> list:
    """The refusals of `layout` to take off: their test ran with the run and is in no gap."""
    return [(where, test) for (where, test) in refusals if where == layout and test in run and test not in gap]


def run_layouts(args, tests_dir: str, out: str) -> dict:
    """{variant: (outcomes, minutes)}: each layout's run variant, then its plain variant on
    the tests that failed with the run (`plain_needed`)."""
    outcomes = {}
    for layout in args.layouts:
        plain, run = LAYOUTS[layout]
        outcomes[run] = run_variant(run, tests_dir, out, keyword=args.keyword, jobs=args.jobs,
                                    timeout=args.timeout)
        only = plain_needed(outcomes[run][0])
        outcomes[plain] = run_variant(plain, tests_dir, out, only=only, jobs=args.jobs if len(only) >= 20 else 1,
                                      timeout=args.timeout)
    return outcomes


def read_layouts(args, out: str) -> dict:
    """{variant: (outcomes, nan)} from the files of an earlier run (`--compare_only`)."""
    outcomes = {}
    for variant in (v for layout in args.layouts for v in LAYOUTS[layout]):
        with open(os.path.join(out, f"{variant}.json"), encoding="utf-8") as f:
            outcomes[variant] = json.load(f), float("nan")
    return outcomes


def main(argv=None) -> int:
    args = parse_args(argv)
    tests_dir = fetch.fetch_tests(args.cache)
    out = args.out or os.path.join(args.cache, "results")
    os.makedirs(out, exist_ok=True)
    refusals = load_refusals()
    if args.compare_only:
        outcomes = read_layouts(args, out)
    else:
        try:
            outcomes = run_layouts(args, tests_dir, out)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"make test-keras: {e}", file=sys.stderr)
            return 2
    for layout in args.layouts:
        for variant in LAYOUTS[layout]:
            results, minutes = outcomes[variant]
            ran = "" if variant.startswith("run") else " (run on the tests that fail with the run)"
            print(f"{variant:>15}: {counts(results)}{ran}" + ("" if args.compare_only else f" ({minutes:.1f} min)"))
    unlisted, listed, stale, lines = [], [], [], [
        "| layout | test | error (with the run) | deepest distrib_tf frame | refused because |",
        "| --- | --- | --- | --- | --- |"]
    for layout in args.layouts:
        plain, run = (outcomes[v][0] for v in LAYOUTS[layout])
        if not any(entry.get("routed_fits") for entry in run.values()):
            print(f"make test-keras: no test's fit went through Run.fit on layout {layout}: the run is not live "
                  "in the tests (plugin.py)", file=sys.stderr)
            return 2
        gap = gap_of(plain, run)
        for test, error in sorted(gap.items()):
            reason = refusals.get((layout, test))
            (listed if reason else unlisted).append((layout, test))
            where = run[test].get("where") or ""
            lines.append(f"| {layout} | `{test}` | {error.replace('|', '/')} | {where} | "
                         f"{reason or '**not listed**'} |")
        stale += stale_of(refusals, layout, run, gap)
    with open(os.path.join(out, "gap.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"The gap (pass plainly, fail with the run): {len(listed) + len(unlisted)} tests, {len(listed)} of them "
          f"in refusals.txt; the table: {os.path.join(out, 'gap.md')}")
    for layout, test in stale:
        print(f"Passes now, or fails plainly too, on layout {layout}: take it off refusals.txt: {test}")
    for layout, test in unlisted:
        print(f"FAILED with the run only ({layout}): {test}: {outcomes[LAYOUTS[layout][1]][0][test]['error']}")
    return 1 if unlisted else 0


if __name__ == "__main__":
    sys.exit(main())
