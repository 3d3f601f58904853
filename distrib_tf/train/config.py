"""The main job's settings: `TrainConfig`, validated at construction, one line per mistake.

No TensorFlow here: a notebook or a sweep builds and checks configs without starting it.
"""

import dataclasses
import hashlib
import json

from distrib_tf.cluster import STRATEGY_KINDS as KINDS

MODELS = ("cnn", "transformer")  # distrib_tf.models.MODELS builds them.
OUTER_OPTIMIZERS = {"average": (1.0, 0.0), "nesterov": (0.7, 0.9)}  # Default rate, momentum.
ALLREDUCE_DTYPES = ("float32", "bfloat16", "float16")

MIXED_PRECISION = {"off": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
DEFAULT_DATASETS = {"cnn": "shapes", "transformer": "tokens"}
MODEL_KINDS = {"cnn": "image", "transformer": "text"}
ON_NAN = ("stop", "rollback")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything the main job needs but the `model_dir`; validated at construction.

    Example:

        >>> config = TrainConfig(model="transformer", epochs=1)
        >>> config.dataset
        'tokens'
    """

    model: str = "cnn"
    dataset: str = ""
    data_dir: str | None = None
    epochs: int = 3
    global_batch_size: int = 64
    learning_rate: float = 1e-3
    strategy: str = "auto"
    cpu_replicas: int | None = None
    mixed_precision: str = "off"
    float64: bool = False
    seed: int = 0
    steps_per_epoch: int | None = None
    collective_timeout: float | None = None
    backup_every_steps: int | None = None
    on_nan: str = "stop"
    max_rollbacks: int = 3
    sync: str = "step"
    outer_optimizer: str | None = None
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None
    allreduce_dtype: str = "float32"
    profile_steps: str | None = None
    evaluator_idle_seconds: float = 3600.0
    fresh_start: bool = False
    keep_checkpoints: int | None = 3
    backup_in_background: bool = True

    @property
    def dtype_policy(self) -> str:
        """The Keras dtype policy the job's model is built with."""
        return "float64" if self.float64 else MIXED_PRECISION[self.mixed_precision]

    def __post_init__(self):
        if self.model not in MODELS and not _is_function_spec(self.model):
            invalid_flag("model", self.model, f"one of {', '.join(MODELS)}, or package.module:function")
        if not self.dataset:
            object.__setattr__(self, "dataset", DEFAULT_DATASETS.get(self.model, "shapes"))
        for name in ("epochs", "global_batch_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("cpu_replicas", "steps_per_epoch", "backup_every_steps", "keep_checkpoints"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not self.learning_rate > 0:
            invalid_flag("learning_rate", self.learning_rate, "a number > 0")
        if not self.evaluator_idle_seconds > 0:
            invalid_flag("evaluator_idle_seconds", self.evaluator_idle_seconds, "a number of seconds > 0")
        if self.collective_timeout is not None and not self.collective_timeout > 0:
            invalid_flag("collective_timeout", self.collective_timeout, "a number of seconds > 0")
        if self.mixed_precision not in MIXED_PRECISION:
            invalid_flag("mixed_precision", self.mixed_precision, f"one of {', '.join(MIXED_PRECISION)}")
        if self.float64 and self.mixed_precision != "off":
            invalid_flag("mixed_precision", self.mixed_precision, "off with --float64")
        if self.on_nan not in ON_NAN:
            invalid_flag("on_nan", self.on_nan, f"one of {', '.join(ON_NAN)}")
        if isinstance(self.max_rollbacks, bool) or not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            invalid_flag("max_rollbacks", self.max_rollbacks, "an integer >= 0")
        if self.strategy not in KINDS:
            invalid_flag("strategy", self.strategy, f"one of {', '.join(KINDS)}")
        self.sync_every()  # Checks --sync.
        outer = {"outer_optimizer": self.outer_optimizer, "outer_learning_rate": self.outer_learning_rate,
                 "outer_momentum": self.outer_momentum}
        if self.sync == "step":
            for name, value in outer.items():
                if value is not None:
                    invalid_flag(name, value, "none with --sync=step: outer options need --sync=every:N or epoch")
        if self.outer_optimizer is not None and self.outer_optimizer not in OUTER_OPTIMIZERS:
            invalid_flag("outer_optimizer", self.outer_optimizer, f"one of {', '.join(OUTER_OPTIMIZERS)}")
        if self.outer_learning_rate is not None and not self.outer_learning_rate > 0:
            invalid_flag("outer_learning_rate", self.outer_learning_rate, "a number > 0")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            invalid_flag("outer_momentum", self.outer_momentum, "a number from 0 to below 1")
        if (self.outer_optimizer or "average") == "average":
            for name in ("outer_learning_rate", "outer_momentum"):
                if outer[name] is not None:
                    invalid_flag(name, outer[name], "it only with --outer_optimizer=nesterov (the average "
                             "takes no learning rate or momentum)")
        if self.allreduce_dtype not in ALLREDUCE_DTYPES:
            invalid_flag("allreduce_dtype", self.allreduce_dtype, f"one of {', '.join(ALLREDUCE_DTYPES)}")
        if self.allreduce_dtype == "float16" and self.mixed_precision == "float16":
            invalid_flag("allreduce_dtype", self.allreduce_dtype, "bfloat16 or float32 with "
                         "--mixed_precision=float16: loss-scaled gradients summed in float16 can overflow unseen")
        if self.profile_steps is not None:
            self.profile_range()  # Checks its form; the run's length is checked with the data.
        if self.allreduce_dtype != "float32" and self.sync != "step":
            invalid_flag("allreduce_dtype", self.allreduce_dtype, "float32 with periodic --sync, which "
                     "averages weights, not gradients")

    def check_replicas(self, replicas: int) -> None:
        """Refuses what cannot run on `replicas` replicas (known from TF_CONFIG or the strategy)."""
        if self.mixed_precision == "float16" and replicas > 1:
            raise ValueError(
                f"Invalid value for `--mixed_precision`. Received: 'float16' with {replicas} replicas. Expected "
                "off or bfloat16: under float16, Keras's LossScaleOptimizer decides whether a step is finite "
                "from each replica's own gradients, so replicas can disagree (a hang, or an overflow applied); "
                "bfloat16 needs no loss scaling.")

    def sync_every(self) -> int | None:
        """Steps between weight averages: `None` for `step` (gradients every step), 0 for `epoch`."""
        if self.sync == "step":
            return None
        if self.sync == "epoch":
            return 0
        kind, _, count = self.sync.partition(":")
        if kind != "every" or not count.isdigit() or int(count) < 1:
            invalid_flag("sync", self.sync, "step, epoch or every:N with N a positive integer")
        return int(count)

    def profile_range(self, last_step: int | None = None) -> tuple[int, int] | None:
        """The first and last step to profile (1-based), checked against the run's `last_step`."""
        if self.profile_steps is None:
            return None
        first, _, last = self.profile_steps.partition(",")
        if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
            invalid_flag("profile_steps", self.profile_steps, "A,B: two steps with 1 <= A <= B")
        if last_step is not None and int(last) > last_step:
            invalid_flag("profile_steps", self.profile_steps,
                         f"steps of this run, which ends at step {last_step} (epochs x steps per epoch)")
        return int(first), int(last)

    def outer(self) -> tuple[str, float, float]:
        """The outer optimizer of periodic sync, its learning rate and momentum."""
        name = self.outer_optimizer or "average"
        rate, momentum = OUTER_OPTIMIZERS[name]
        return (name, self.outer_learning_rate if self.outer_learning_rate is not None else rate,
                self.outer_momentum if self.outer_momentum is not None else momentum)


    def run_id(self) -> str:
        """What a backup must match to be resumed: every field that changes the math."""
        fields = dataclasses.asdict(self)
        for name in ("epochs", "data_dir", "strategy", "cpu_replicas", "collective_timeout",
                     "backup_every_steps", "on_nan", "max_rollbacks", "profile_steps", "evaluator_idle_seconds",
                     "fresh_start", "keep_checkpoints", "backup_in_background"):
            fields.pop(name)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _is_function_spec(value) -> bool:
    """`package.module:function`, as a user's model builder is named (`distrib_tf.train.builders`)."""
    module, _, function = str(value).partition(":")
    return bool(function) and function.isidentifier() and all(part.isidentifier() for part in module.split("."))


def invalid_flag(flag, value, expected):
    raise ValueError(f"Invalid value for `--{flag}`. Received: {value!r}. Expected {expected}.")


def _check_positive_int(flag, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        invalid_flag(flag, value, "a positive integer")
