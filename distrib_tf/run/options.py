"""`RunOptions`: what a run does beyond `fit`'s arguments, validated at construction.

No TensorFlow here.
"""

import dataclasses

from distrib_tf.run.ending import InvalidRun

ON_NAN = ("stop", "rollback")
OUTER = {"average": (1.0, 0.0), "nesterov": (0.7, 0.9)}  # Default outer rate and momentum.


def invalid(argument: str, value, expected: str):
    raise InvalidRun(f"Invalid value for argument `{argument}`. Received: {argument}={value!r}. "
                     f"Expected {expected}.")


def check_positive(argument: str, value, *, optional: bool = True):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        invalid(argument, value, "a positive integer")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What a run does beyond `fit`'s arguments; validated at construction.

    See `Run` for each field.
    """

    seed: int = 0
    backup_every_steps: int | None = None
    on_nan: str = "stop"
    max_rollbacks: int = 3
    sync: str = "step"
    outer_optimizer: str = "average"
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None
    allreduce_dtype: str = "float32"
    run_id: str | None = None
    keep_checkpoints: int | None = 3
    backup_in_background: bool = True

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            invalid("seed", self.seed, "an integer")
        check_positive("backup_every_steps", self.backup_every_steps)
        check_positive("keep_checkpoints", self.keep_checkpoints)
        if not isinstance(self.backup_in_background, bool):
            invalid("backup_in_background", self.backup_in_background, "True or False")
        if self.on_nan not in ON_NAN:
            invalid("on_nan", self.on_nan, f"one of {', '.join(ON_NAN)}")
        if isinstance(self.max_rollbacks, bool) or not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            invalid("max_rollbacks", self.max_rollbacks, "an integer >= 0")
        self.sync_every()
        if self.outer_optimizer not in OUTER:
            invalid("outer_optimizer", self.outer_optimizer, f"one of {', '.join(OUTER)}")
        if self.allreduce_dtype not in ("float32", "bfloat16", "float16"):
            invalid("allreduce_dtype", self.allreduce_dtype, "float32, bfloat16 or float16")
        if self.allreduce_dtype != "float32" and self.sync != "step":
            invalid("allreduce_dtype", self.allreduce_dtype, "float32 with periodic sync, which averages "
                     "weights, not gradients")

    def sync_every(self) -> int | None:
        """Steps between weight averages: `None` for `step`, 0 for `epoch`."""
        if self.sync == "step":
            return None
        if self.sync == "epoch":
            return 0
        kind, _, count = str(self.sync).partition(":")
        if kind != "every" or not count.isdigit() or int(count) < 1:
            invalid("sync", self.sync, "'step', 'epoch' or 'every:N' with N a positive integer")
        return int(count)

    def outer(self) -> tuple[str, float, float]:
        rate, momentum = OUTER[self.outer_optimizer]
        return (self.outer_optimizer, rate if self.outer_learning_rate is None else self.outer_learning_rate,
                momentum if self.outer_momentum is None else self.outer_momentum)
