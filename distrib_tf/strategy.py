"""The strategy factory: `TF_CONFIG` or a kind name in, a `tf.distribute.Strategy` out.

Which strategy `make_strategy()` builds, by precedence:

1. an explicit `kind` other than `"auto"` (a local kind is refused for a training
   task of a `TF_CONFIG` with several: it would train separate copies);
2. `TF_CONFIG` naming more than one training task: `MultiWorkerMirroredStrategy`;
3. more than one visible GPU, or `cpu_replicas > 1`: `MirroredStrategy`;
4. otherwise `OneDeviceStrategy` on the first GPU, else the CPU.

The Keras 3 fixes of `distrib_tf.keras.compat` are applied, so `model.fit`, `evaluate` and `predict` work
under it. `TF_CONFIG` is validated first: a wrong one is a one-line `ClusterSpecError`,
never a TensorFlow hang.

`make_strategy()` must run before TensorFlow runs any operation: a multi-worker
strategy and logical CPU devices are configured when the runtime starts.
"""

import dataclasses
import importlib.util
import itertools
import logging
import os

import tensorflow as tf
from tensorflow.python.eager import context as _context

from distrib_tf import cluster
from distrib_tf.cluster import STRATEGY_KINDS as KINDS
from distrib_tf.keras import compat

logger = logging.getLogger("distrib_tf")

COMMUNICATIONS = ("auto", "ring", "nccl")
TIMEOUT_ENV = "DISTRIB_TF_COLLECTIVE_TIMEOUT"  # Set by `distrib_tf.launch --collective_timeout`.


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """The choices behind a strategy, validated at construction.

    Attributes:
        strategy: one of `KINDS`.
        cpu_replicas: split the CPU into this many logical devices for a mirrored
            strategy where there is no GPU; `None` leaves the devices alone.
        communication: all-reduce implementation, one of `COMMUNICATIONS`.
        bytes_per_pack: pack gradients into all-reduces of about this many bytes
            (multi-worker only); 0 lets TensorFlow choose.
        collective_timeout: a collective that takes longer fails with
            `DeadlineExceededError` instead of hanging (multi-worker only).
    """

    strategy: str = "auto"
    cpu_replicas: int | None = None
    communication: str = "auto"
    bytes_per_pack: int = 0
    collective_timeout: float | None = None

    def __post_init__(self):
        _check_choice("strategy", self.strategy, KINDS)
        _check_choice("communication", self.communication, COMMUNICATIONS)
        if self.cpu_replicas is not None and (
            isinstance(self.cpu_replicas, bool)
            or not isinstance(self.cpu_replicas, int)
            or self.cpu_replicas < 1
        ):
            _raise("cpu_replicas", self.cpu_replicas, "a positive integer or None")
        if isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            _raise("bytes_per_pack", self.bytes_per_pack, "an integer >= 0")
        if self.collective_timeout is not None and not (
            isinstance(self.collective_timeout, (int, float)) and self.collective_timeout > 0
        ):
            _raise("collective_timeout", self.collective_timeout, "a number of seconds > 0, or None")


def _float_from_env(name):
    try:
        return float(os.environ[name])
    except ValueError as e:
        raise ValueError(f"Invalid value for environment variable `{name}`. Received: "
                         f"{os.environ[name]!r}. Expected a number of seconds.") from e


def _raise(name, value, expected):
    raise ValueError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
        f"Expected {expected}."
    )


def _check_choice(name, value, choices):
    if value not in choices:
        _raise(name, value, "one of " + ", ".join(repr(c) for c in choices))


def make_strategy(
    strategy: str = "auto",
    *,
    cpu_replicas: int | None = None,
    communication: str = "auto",
    bytes_per_pack: int = 0,
    collective_timeout: float | None = None,
) -> tf.distribute.Strategy:
    """Builds the `tf.distribute.Strategy` for this process.

    Args:
        strategy: `"auto"`, `"one_device"`, `"mirrored"` or `"multi_worker"`; see the
            module docstring for what `"auto"` picks.
        cpu_replicas: with no GPU, split the CPU into this many logical devices and
            mirror over them (useful to try data parallelism on a laptop).
        communication: `"auto"`, `"ring"` or `"nccl"` all-reduce; `"auto"` is NCCL
            where there are GPUs (on one host and across workers), else TensorFlow's choice.
        bytes_per_pack: multi-worker gradient packing, in bytes (0: TensorFlow's).
        collective_timeout: multi-worker collective timeout; a lost peer then
            surfaces as an error after this long instead of a hang. Default: the
            `DISTRIB_TF_COLLECTIVE_TIMEOUT` environment variable, else none.

    Returns:
        The strategy. Build and compile Keras models under `strategy.scope()`.

    Raises:
        ValueError: an invalid argument, or `TF_CONFIG` that does not validate
            (`distrib_tf.ClusterSpecError`).
        RuntimeError: TensorFlow's runtime already started and the strategy needs
            to configure it.

    Example:

        >>> import keras
        >>> strategy = make_strategy(cpu_replicas=2)
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
    """
    if collective_timeout is None and os.environ.get(TIMEOUT_ENV):
        collective_timeout = _float_from_env(TIMEOUT_ENV)
    _drop_legacy_keras_without_tf_keras()
    options = StrategyOptions(
        strategy=strategy,
        cpu_replicas=cpu_replicas,
        communication=communication,
        bytes_per_pack=bytes_per_pack,
        collective_timeout=collective_timeout,
    )
    tf_config = cluster.load_tf_config()
    _check_layout(options.strategy, tf_config)
    kind = options.strategy
    if kind == "auto":
        kind = _auto_kind(tf_config, options)
    if kind == "multi_worker":
        strategy = _make_multi_worker(tf_config, options)
    elif kind == "mirrored":
        strategy = _make_mirrored(options)
    else:
        strategy = _make_one_device()
    compat.apply()
    logger.info(describe_strategy(strategy))
    return strategy


LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"


def _drop_legacy_keras_without_tf_keras() -> None:
    """Ray Train sets `TF_USE_LEGACY_KERAS=1` in its TensorFlow workers: where tf_keras is
    not installed, `tf.keras` then fails to import, here and in every child process."""
    if os.environ.get(LEGACY_KERAS_ENV) and importlib.util.find_spec("tf_keras") is None:
        logger.info("%s is set but tf_keras is not installed: unset, tf.keras is Keras 3",
                    LEGACY_KERAS_ENV)
        del os.environ[LEGACY_KERAS_ENV]


def _check_layout(kind: str, tf_config) -> None:
    """Refuses a local `kind` for a training task of a cluster (N trainings, one model_dir)."""
    if tf_config is None or kind in ("auto", "multi_worker"):
        return
    spec, task = tf_config
    if spec.num_workers > 1 and task.type != "evaluator":
        raise ValueError(
            f"Invalid value for argument `strategy`. Received: strategy={kind!r} while TF_CONFIG "
            f"names {spec.num_workers} training tasks (this is {task}). Expected 'auto' or "
            f"'multi_worker': {kind!r} would train {spec.num_workers} separate copies that "
            "all write as chief. Unset TF_CONFIG to train on this host alone."
        )


def _auto_kind(tf_config, options: StrategyOptions) -> str:
    if tf_config is not None:
        spec, task = tf_config
        if spec.num_workers > 1 and task.type != "evaluator":
            return "multi_worker"
    if len(tf.config.list_physical_devices("GPU")) > 1 or (options.cpu_replicas or 1) > 1:
        return "mirrored"
    return "one_device"


def _runtime_started() -> bool:
    return _context.context()._context_handle is not None  # pylint: disable=protected-access


def _refuse_started_runtime(what: str):
    raise RuntimeError(
        f"make_strategy() must be called before TensorFlow runs any operation: {what} "
        "is configured when the TensorFlow runtime starts, and it has already started "
        "in this process. Call make_strategy() first (in a notebook, restart the kernel)."
    )


def _split_cpu(replicas: int) -> list[str]:
    """Returns the names of `replicas` logical CPU devices, creating them if needed."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) != replicas:
        if _runtime_started():
            _refuse_started_runtime(f"cpu_replicas={replicas}")
        tf.config.set_logical_device_configuration(cpu, wanted)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


# A MirroredStrategy's collectives are named by group keys that TensorFlow starts at 1 for
# every strategy: a second one in the process (a notebook cell run again) reused the first's
# keys, and its first all-reduce of another dtype or shape failed ("Collective instance 100
# expected type 0 and data_type 1 but got type 0 and data_type 2"). Each strategy made here
# starts at a base of its own: the attribute TensorFlow's own tests set on the class, set on
# the strategy being made (nothing of TensorFlow's is changed for the rest of the process).
_KEYS_APART = 1000  # A strategy uses one group key per set of devices.
_mirrored_made = itertools.count(1)


def _make_mirrored(options: StrategyOptions) -> tf.distribute.Strategy:
    if tf.config.list_physical_devices("GPU"):
        devices = [d.name for d in tf.config.list_logical_devices("GPU")]
        cross_device_ops = (
            tf.distribute.NcclAllReduce() if options.communication == "nccl" else None
        )
    else:
        devices = _split_cpu(options.cpu_replicas or 1)
        cross_device_ops = None
    # The base is read by MirroredExtended from the strategy being made, before __init__ ends.
    strategy = tf.distribute.MirroredStrategy.__new__(tf.distribute.MirroredStrategy)
    strategy._collective_key_base = _KEYS_APART * next(_mirrored_made)  # pylint: disable=protected-access
    strategy.__init__(devices=devices, cross_device_ops=cross_device_ops)
    return strategy


def _make_one_device() -> tf.distribute.Strategy:
    gpus = tf.config.list_physical_devices("GPU")
    return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")


def _make_multi_worker(tf_config, options: StrategyOptions) -> tf.distribute.Strategy:
    if tf_config is None:
        raise ValueError(
            "Invalid value for argument `strategy`. Received: strategy='multi_worker' with no "
            "TF_CONFIG set. Expected TF_CONFIG naming this task's cluster; start the "
            "workers with `python -m distrib_tf.launch --cluster_spec=PATH -- ...`."
        )
    if options.cpu_replicas not in (None, 1):
        _raise(
            "cpu_replicas", options.cpu_replicas,
            "None or 1 with strategy='multi_worker': a multi-worker strategy trains on "
            "one CPU device per worker",
        )
    if _runtime_started():
        _refuse_started_runtime("a multi-worker strategy")
    # On GPUs, "auto" is NCCL, as it is for MirroredStrategy; TensorFlow's AUTO may pick RING.
    auto = "NCCL" if tf.config.list_physical_devices("GPU") else "AUTO"
    implementation = {
        "auto": getattr(tf.distribute.experimental.CommunicationImplementation, auto),
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[options.communication]
    communication_options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=options.collective_timeout,
        implementation=implementation,
    )
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=communication_options
    )


def strategy_name(strategy: tf.distribute.Strategy) -> str:
    """The public class name, e.g. `MultiWorkerMirroredStrategy` (not its private alias)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"
    return type(strategy).__name__


def describe_strategy(strategy: tf.distribute.Strategy) -> str:
    """One line: what strategy, how many workers and replicas, on which devices."""
    extended = strategy.extended
    devices = ",".join(extended.worker_devices)
    name = strategy_name(strategy)
    line = f"{name}: {strategy.num_replicas_in_sync} replica(s)"
    if name == "MultiWorkerMirroredStrategy":
        resolver = strategy.cluster_resolver
        jobs = resolver.cluster_spec().as_dict()
        workers = len(jobs.get("chief", [])) + len(jobs.get("worker", []))
        communication = extended._communication_options.implementation.name  # pylint: disable=protected-access
        line += (
            f" on {workers} worker(s), this is {resolver.task_type}:{resolver.task_id}, "
            f"communication={communication}"
        )
    return f"{line}, devices={devices}"
