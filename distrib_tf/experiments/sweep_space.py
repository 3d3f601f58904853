"""The search space of a sweep: `NAME=VALUES` text or JSON, and Optuna suggestions from it.

One `NAME=VALUES` item per hyperparameter: a name the user's script declares in its
`distrib_tf.params(...)` (any identifier; its values' type read from how they are
written), or a flag of the main job (`SWEEPABLE`, typed by the flag):

- `[a,b,c]`: these values (grid or random choice): integers, numbers or words;
- `linspace(a,b,n)`, `logspace(a,b,n)`: n values from a to b, evenly or on a log scale;
- `uniform(a,b)`, `loguniform(a,b)`: any number (random and tpe samplers only);
- `int(a,b)`, `logint(a,b)`: any integer from a to b (random and tpe samplers only).

A JSON object says the same: `{"learning_rate": {"loguniform": [1e-4, 1e-2]},
"global_batch_size": [32, 64]}`. Bad input raises `ValueError` with one line.
This module imports no TensorFlow.
"""

import dataclasses
import math
import re

SWEEPABLE = {
    "learning_rate": float, "global_batch_size": int, "epochs": int, "steps_per_epoch": int,
    "mixed_precision": str, "seed": int, "model": str, "dataset": str, "cpu_replicas": int,
}
_FORM = re.compile(r"^(linspace|logspace|uniform|loguniform|int|logint)\((.*)\)$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One swept flag: a list of values, or a continuous range."""

    name: str
    values: tuple = ()
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False  # A range of an integer flag: drawn as integers.

    @property
    def is_range(self) -> bool:
        return not self.values


def _number(text: str, name: str, kind=float):
    try:
        return kind(text)
    except ValueError as e:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected {'an integer' if kind is int else 'a number'}.") from e


def _written_kind(items: list[str]) -> type:
    """The type a list's values are written in: int, float, or str."""
    for kind in (int, float):
        try:
            [kind(i) for i in items]  # pylint: disable=expression-not-assigned
            return kind
        except ValueError:
            pass
    return str


def parse_dimension(name: str, spec, kinds: dict | None = SWEEPABLE) -> Dimension:
    """Parses one hyperparameter's values from text (`[..]`, `linspace(..)`, ...) or JSON;
    `kinds`: the main job's flags and their types, or `None` for a user's script (any name)."""
    if kinds is not None and name not in kinds:
        raise ValueError(f"Invalid flag `{name}` in the search space. Expected one of "
                         f"{', '.join(sorted(kinds))}.")
    if kinds is None and not _NAME.match(name):
        raise ValueError(f"Invalid name `{name}` in the search space. Expected a Python identifier, "
                         "as the script's distrib_tf.params(...) names it.")
    if isinstance(spec, dict) and len(spec) == 1:
        (form, args), = spec.items()
        spec = f"{form}({','.join(map(str, args))})" if isinstance(args, list) else None
    if isinstance(spec, list):
        spec = "[" + ",".join(map(str, spec)) + "]"
    if not isinstance(spec, str):
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {spec!r}. "
                         "Expected a list, or one of linspace, logspace, uniform, loguniform.")
    text = spec.strip()
    items = [t.strip() for t in text[1:-1].split(",") if t.strip()]
    form = _FORM.match(text)
    kind = kinds[name] if kinds is not None else _written_kind(items) if text.startswith("[") else (
        int if form and form.group(1) in ("int", "logint") else float)
    if text.startswith("[") and text.endswith("]"):
        if not items:
            raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                             "Expected at least one value, such as [1e-3,3e-3].")
        return Dimension(name, tuple(kind(i) if kind is str else _number(i, name, kind) for i in items))
    if not form or kind is str:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         "Expected [a,b,...], linspace(a,b,n), logspace(a,b,n), uniform(a,b), "
                         "loguniform(a,b), int(a,b) or logint(a,b).")
    args = [a.strip() for a in form.group(2).split(",")]
    is_grid = form.group(1) in ("linspace", "logspace")
    if len(args) != (3 if is_grid else 2):
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected {form.group(1)}({'a,b,n' if is_grid else 'a,b'}).")
    if form.group(1) in ("int", "logint") and kind is not int:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected numbers for a {kind.__name__} flag: uniform(a,b) or loguniform(a,b).")
    bound = int if kind is int and not is_grid else float  # uniform(2,8) of an integer flag: integers.
    low, high = _number(args[0], name, bound), _number(args[1], name, bound)
    log = form.group(1).startswith("log")
    if not low < high or (log and low <= 0):
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         f"Expected a < b{' and a > 0 on a log scale' if log else ''}.")
    if not is_grid:
        return Dimension(name, low=low, high=high, log=log, integer=kind is int)
    count = _number(args[2], name, int)
    if count < 2:
        raise ValueError(f"Invalid value for `{name}` in the search space. Received: {text!r}. "
                         "Expected n >= 2.")
    points = [math.exp(math.log(low) + i * (math.log(high) - math.log(low)) / (count - 1)) if log
              else low + i * (high - low) / (count - 1) for i in range(count)]
    return Dimension(name, tuple(kind(round(p, 12)) if kind is int else p for p in points))


def parse_space(text: str = "", data: dict | None = None, kinds: dict | None = SWEEPABLE) -> list[Dimension]:
    """The search space from `NAME=VALUES ...` text and/or a JSON object (see `parse_dimension`)."""
    dimensions = {}
    for name, spec in (data or {}).items():
        dimensions[name] = parse_dimension(name, spec, kinds)
    for item in re.findall(r"(\S+?)=(\[[^\]]*\]|\w+\([^)]*\)|\S+)", text or ""):
        dimensions[item[0]] = parse_dimension(*item, kinds)
    leftover = re.sub(r"(\S+?)=(\[[^\]]*\]|\w+\([^)]*\)|\S+)", "", text or "").strip()
    if leftover:
        raise ValueError(f"Invalid value for `--space`. Received: {leftover!r}. Expected "
                         "NAME=VALUES items, such as learning_rate=[1e-3,3e-3].")
    if not dimensions:
        raise ValueError("Empty search space. Expected --space='NAME=VALUES ...' or --space_file.")
    return list(dimensions.values())


def grid_size(space: list[Dimension]) -> int:
    """Points of the grid; raises for a continuous range, which no grid holds."""
    ranges = [d.name for d in space if d.is_range]
    if ranges:
        raise ValueError(f"Invalid search space for --sampler=grid: {', '.join(ranges)} is a "
                         "continuous range. Expected lists or linspace/logspace, or --sampler=random.")
    return math.prod(len(d.values) for d in space)


def suggest(trial, space: list[Dimension]) -> dict:
    """The values of one Optuna trial: a choice from each list, a draw from each range
    (an integer for an integer flag or `int(a,b)`)."""
    def draw(d):
        if not d.is_range:
            return trial.suggest_categorical(d.name, list(d.values))
        if d.integer:
            return trial.suggest_int(d.name, d.low, d.high, log=d.log)
        return trial.suggest_float(d.name, d.low, d.high, log=d.log)

    return {d.name: draw(d) for d in space}
